"""Fine-tune a causal LM (GPT-2 by default) with the Transformers Trainer on hf_elixir.

    hf-elixir launch --config_file examples/accelerate_configs/elixir.yaml \
        examples/finetune_gpt2_trainer.py --model_name_or_path gpt2 \
        --train_file my_text.txt --output_dir out/gpt2-ft --num_train_epochs 1

The only hf_elixir-specific lines are the two imports below: ElixirTrainingArguments adds
``--elixir`` / ``--elixir_config`` (and turns on by itself under ``hf-elixir launch``), and
ElixirTrainer shards the model with the plan the planner picks. Prints the held-out
perplexity and a greedy sample before and after training, saves the model, and checks that
``from_pretrained`` reloads it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, default_data_collator, set_seed

from clm_data import load_text, tokenize_and_pack
from hf_elixir.integrations import ElixirTrainer, ElixirTrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="gpt2", metadata={"help": "hub id or local folder"})


@dataclass
class DataArguments:
    dataset_name: Optional[str] = field(default=None, metadata={"help": "a `datasets` dataset name"})
    dataset_config_name: Optional[str] = None
    train_file: Optional[str] = field(default=None, metadata={"help": "a local text file"})
    validation_file: Optional[str] = None
    validation_split_percentage: int = 5
    block_size: int = 128
    prompt: str = field(default="The", metadata={"help": "prompt of the greedy samples"})
    sample_tokens: int = 40


def sample(trainer, tokenizer, prompt: str, tokens: int) -> str:
    """A greedy continuation; every process takes part (the model is sharded)."""
    model = trainer.model_wrapped
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def perplexity(metrics: dict) -> float:
    return math.exp(min(metrics["eval_loss"], 50.0))


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, ElixirTrainingArguments))
    model_args, data_args, args = parser.parse_args_into_dataclasses()
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    block = min(data_args.block_size, getattr(model.config, "n_positions", data_args.block_size))
    raw = load_text(data_args.dataset_name, data_args.dataset_config_name, data_args.train_file,
                    data_args.validation_file, data_args.validation_split_percentage)
    with args.main_process_first(desc="dataset preparation"):
        data = tokenize_and_pack(raw, tokenizer, block)

    trainer = ElixirTrainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["validation"],
                            processing_class=tokenizer, data_collator=default_data_collator)
    main_process = trainer.is_world_process_zero()

    before = trainer.evaluate()
    text_before = sample(trainer, tokenizer, data_args.prompt, data_args.sample_tokens)
    if main_process:
        print(f"held-out perplexity before: {perplexity(before):.2f}", flush=True)
        print(f"sample before: {text_before!r}", flush=True)

    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = trainer.evaluate()
    text_after = sample(trainer, tokenizer, data_args.prompt, data_args.sample_tokens)
    trainer.save_model(args.output_dir)
    if main_process:
        print(f"held-out perplexity after: {perplexity(after):.2f} (before: {perplexity(before):.2f})", flush=True)
        print(f"sample after: {text_after!r}", flush=True)
        reloaded = AutoModelForCausalLM.from_pretrained(args.output_dir).eval()
        ids = tokenizer(data_args.prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            again = reloaded.generate(ids, max_new_tokens=data_args.sample_tokens, do_sample=False,
                                      pad_token_id=tokenizer.eos_token_id)
        same = tokenizer.decode(again[0], skip_special_tokens=True) == text_after
        print(f"saved to {args.output_dir}; from_pretrained gives the same sample: {same}", flush=True)
        if not same:
            sys.exit("the reloaded model does not reproduce the trained model's sample")


if __name__ == "__main__":
    main()
