"""Fine-tune a causal LM (GPT-2 by default) with a custom Accelerate loop on hf_elixir.

    hf-elixir launch --config_file examples/accelerate_configs/elixir.yaml \
        examples/finetune_gpt2_accelerate.py --model_name_or_path gpt2 --train_file my_text.txt

The one hf_elixir-specific line is the import of ElixirAccelerator (under ``hf-elixir
launch`` even ``from accelerate import Accelerator`` gets it). The plan is made from the
first training batch when the model is prepared. Prints a progress bar, the loss, held-out
perplexity before and after, and saves a ``from_pretrained`` folder.
"""

from __future__ import annotations

import argparse
import math

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_linear_schedule_with_warmup

from clm_data import load_text, tokenize_and_pack
from hf_elixir.integrations import ElixirAccelerator


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default="gpt2", help="hub id or local folder")
    p.add_argument("--dataset_name", default=None)
    p.add_argument("--dataset_config_name", default=None)
    p.add_argument("--train_file", default=None)
    p.add_argument("--validation_file", default=None)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_train_steps", type=int, default=100)
    p.add_argument("--warmup_steps", type=int, default=10)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--output_dir", default="out/gpt2-accelerate")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def evaluate(accelerator, model, loader) -> float:
    model.eval()
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.reshape(1)))
    model.train()
    return math.exp(min(torch.cat(losses).mean().item(), 50.0))


def main() -> None:
    args = parse_args()
    accelerator = ElixirAccelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    block = min(args.block_size, getattr(model.config, "n_positions", args.block_size))
    raw = load_text(args.dataset_name, args.dataset_config_name, args.train_file, args.validation_file)
    with accelerator.main_process_first():
        data = tokenize_and_pack(raw, tokenizer, block)
    train = torch.utils.data.DataLoader(data["train"], batch_size=args.per_device_batch_size, shuffle=True,
                                        collate_fn=default_data_collator)
    valid = torch.utils.data.DataLoader(data["validation"], batch_size=args.per_device_batch_size,
                                        collate_fn=default_data_collator)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_train_steps)
    # any order: loaders are prepared first, the plan is made for the first training batch
    model, optimizer, train, valid, scheduler = accelerator.prepare(model, optimizer, train, valid, scheduler)

    accelerator.print(f"held-out perplexity before: {evaluate(accelerator, model, valid):.2f}")
    bar = tqdm(total=args.max_train_steps, disable=not accelerator.is_local_main_process, desc="fine-tuning")
    step = 0
    while step < args.max_train_steps:
        for batch in train:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
                if step >= args.max_train_steps:
                    break
    bar.close()
    accelerator.print(f"held-out perplexity after: {evaluate(accelerator, model, valid):.2f}")
    accelerator.save_model(model, args.output_dir)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        AutoModelForCausalLM.from_pretrained(args.output_dir)  # the folder loads
        print(f"saved to {args.output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
