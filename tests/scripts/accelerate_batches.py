"""An ordinary Accelerate loop (standard imports only) fed batches of one structure.

``--batches`` picks what the loop sees:

* ``tensor``: ``DataLoader(tensor, batch_size=2)``, each batch a tensor;
* ``tuple``: ``DataLoader(TensorDataset(x, y))``, each batch a list ``[x, y]``;
* ``dict``: a dataset of dicts with custom keys (``tokens``, ``weight``), each batch a dict;
* ``model-first``: the model prepared alone, the optimizer built over the prepared model's
  parameters, then optimizer, loader and scheduler prepared in a second call;
* ``generator``: no DataLoader at all; each rank draws its own batches from a generator
  (rank 1's sequences are shorter than rank 0's).

The first four train on the same token rows in the same order (Accelerate's sharding of a
batch-size-2 loader over 2 processes), so their losses and weights are the same. Rank 0
writes per-step losses, gradient norms, the final weights and what was prepared to
``--out``.
"""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--batches", required=True, choices=["tensor", "tuple", "dict", "model-first", "generator"])
p.add_argument("--steps", type=int, default=3)
p.add_argument("--accumulation", type=int, default=2)
p.add_argument("--early_save", default=None, help="try save_state here before the first forward")
args = p.parse_args()

accelerator = Accelerator(gradient_accumulation_steps=args.accumulation)
torch.manual_seed(0)
config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
ids = torch.randint(0, 96, (64, 16), generator=torch.Generator().manual_seed(1))


class Records(Dataset):
    """Dicts with keys a model has never heard of."""

    def __len__(self):
        return len(ids)

    def __getitem__(self, i):
        return {"tokens": ids[i], "weight": 1.0}


def make_optimizer(params):
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, eps=1e-6)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))


def own_batches():
    """Rank r's k-th batch: two rows of its own, rank 1's four tokens shorter."""
    rank, world = accelerator.process_index, accelerator.num_processes
    for k in range(args.steps * args.accumulation):
        start = (k * world + rank) * 2
        yield ids[start:start + 2, : 16 - 4 * rank]


prepared = None
if args.batches == "model-first":
    model = accelerator.prepare(model)
    prepared = type(model).__name__
    optimizer, scheduler = make_optimizer(model.parameters())
    loader = DataLoader(TensorDataset(ids), batch_size=2, shuffle=False)
    optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    batches = (b[0] for b in loader)
elif args.batches == "generator":
    optimizer, scheduler = make_optimizer(model.parameters())
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    batches = own_batches()
else:
    if args.batches == "tensor":
        loader = DataLoader(ids, batch_size=2, shuffle=False)
    elif args.batches == "tuple":
        loader = DataLoader(TensorDataset(ids, ids.clone()), batch_size=2, shuffle=False)
    else:
        loader = DataLoader(Records(), batch_size=2, shuffle=False)
    optimizer, scheduler = make_optimizer(model.parameters())
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    batches = iter(loader)
prepared = prepared or type(model).__name__

early_save_error = None
if args.early_save:
    try:
        accelerator.save_state(args.early_save)
    except Exception as e:  # what the user is told
        early_save_error = f"{type(e).__name__}: {e}"

losses, norms = [], []
model.train()
for step in range(args.steps):
    total = torch.zeros(())
    for _ in range(args.accumulation):
        batch = next(batches)
        if args.batches == "tuple":
            x, y = batch
        elif args.batches == "dict":
            x = y = batch["tokens"]
        else:
            x = y = batch
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=y).loss
            accelerator.backward(loss)
            total += loss.detach() / args.accumulation
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    losses.append(float(accelerator.reduce(total, reduction="mean")))

state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    torch.save({"losses": losses, "norms": norms, "state": state, "prepared": prepared,
                "is_elixir": bool(getattr(accelerator, "is_elixir", False)),
                "lr": optimizer.param_groups[0]["lr"], "early_save_error": early_save_error}, args.out)
accelerator.wait_for_everyone()
accelerator.end_training()
