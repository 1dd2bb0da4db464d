"""A custom Accelerate training loop with standard imports only (the test's "user script").

Trains a tiny GPT-2 on fixed random tokens with gradient accumulation, clipping, AdamW and a
warm-up schedule; rank 0 writes the per-step losses, the final weights and whether hf_elixir
was active to ``--out`` (a torch file). ``--elixir`` builds ElixirAccelerator explicitly;
without it the script is what any Accelerate user writes.
"""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--elixir", action="store_true")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--accumulation", type=int, default=2)
p.add_argument("--save_state", default=None, help="save_state here after the last step")
p.add_argument("--load_state", default=None, help="load_state from here before training")
args = p.parse_args()

if args.elixir:
    from hf_elixir.integrations import ElixirAccelerator, ElixirPlugin

    accelerator = ElixirAccelerator(gradient_accumulation_steps=args.accumulation, elixir_plugin=ElixirPlugin())
else:
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation)

torch.manual_seed(0)
config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
ids = torch.randint(0, 96, (64, 16), generator=torch.Generator().manual_seed(1))
loader = DataLoader(TensorDataset(ids), batch_size=2, shuffle=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
if args.load_state:
    accelerator.load_state(args.load_state)

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
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    losses.append(float(accelerator.reduce(total, reduction="mean")))

if args.save_state:
    accelerator.save_state(args.save_state)
state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    torch.save({"losses": losses, "norms": norms, "state": state,
                "is_elixir": bool(getattr(accelerator, "is_elixir", False)),
                "type": type(accelerator).__name__, "world": accelerator.num_processes,
                "distributed_type": str(accelerator.distributed_type)}, args.out)
accelerator.wait_for_everyone()
accelerator.end_training()
