"""A LoRA fine-tuning loop written the way PEFT's Accelerate examples are (the tests' "user script").

Loads a base causal LM with ``from_pretrained``, wraps it with ``get_peft_model``, and trains
it with ``accelerator.prepare``/``accelerate``/``backward``/``clip_grad_norm_`` (gradient
accumulation, AdamW over ``model.parameters()`` as PEFT's examples build it, a warm-up
schedule). Then it saves the adapter twice, the two ways PEFT scripts do: with
``accelerator.save_model`` into ``--out_dir/save_model`` and with
``accelerator.unwrap_model(model).save_pretrained(..., state_dict=accelerator.get_state_dict(model))``
(PEFT's examples) into ``--out_dir/unwrapped``; ``--save_state`` adds ``accelerator.save_state``.
It also records what ``save_pretrained`` without ``state_dict`` does (on every process).

``--elixir`` builds hf_elixir's ElixirAccelerator explicitly; without it nothing here names
hf_elixir. Rank 0 writes the per-step losses, gradient norms, the full state after training,
logits on a fixed input and what ran it to ``--out_dir/result.pt``.
"""

import argparse
import os

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--base", required=True, help="a from_pretrained folder of the base model")
p.add_argument("--target_modules", default="c_attn")
p.add_argument("--out_dir", required=True)
p.add_argument("--elixir", action="store_true")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--accumulation", type=int, default=2)
p.add_argument("--save_state", default=None, help="save_state here after the last step")
args = p.parse_args()

if args.elixir:
    from hf_elixir.integrations import ElixirAccelerator, ElixirPlugin

    accelerator = ElixirAccelerator(gradient_accumulation_steps=args.accumulation,
                                    elixir_plugin=ElixirPlugin(rcache_blocks=2))
else:
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation)

torch.manual_seed(0)
base = AutoModelForCausalLM.from_pretrained(args.base)
model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                        target_modules=args.target_modules.split(",")))
vocab = model.config.vocab_size
ids = torch.randint(0, vocab, (64, 16), generator=torch.Generator().manual_seed(1))
loader = DataLoader(TensorDataset(ids), batch_size=2, shuffle=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, eps=1e-6)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

losses, norms = [], []
model.train()
it = iter(loader)
for step in range(args.steps):
    total = torch.zeros(())
    for _ in range(args.accumulation):
        (batch,) = next(it)
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            total += loss.detach() / args.accumulation
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    losses.append(float(accelerator.reduce(total, reduction="mean")))

model.eval()
with torch.no_grad():
    logits = model(input_ids=torch.arange(16).reshape(1, 16) % vocab).logits.float()

accelerator.wait_for_everyone()
accelerator.save_model(model, os.path.join(args.out_dir, "save_model"))
unwrapped = accelerator.unwrap_model(model)
unwrapped.save_pretrained(os.path.join(args.out_dir, "unwrapped"), is_main_process=accelerator.is_main_process,
                          save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
# without state_dict, PEFT reads the parameters itself: where they are sharded that must fail
# clearly on every process (not save an empty or partial adapter)
try:
    unwrapped.save_pretrained(os.path.join(args.out_dir, "no_state_dict"), is_main_process=accelerator.is_main_process)
    without_state_dict = "saved"
except Exception as e:  # recorded for the test, which checks the message
    without_state_dict = f"{type(e).__name__}: {e}"
if args.save_state:
    accelerator.save_state(args.save_state)
state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    torch.save({"losses": losses, "norms": norms, "state": state, "logits": logits,
                "without_state_dict": without_state_dict,
                "is_elixir": bool(getattr(accelerator, "is_elixir", False)),
                "type": type(accelerator).__name__, "world": accelerator.num_processes},
               os.path.join(args.out_dir, "result.pt"))
accelerator.wait_for_everyone()
accelerator.end_training()
