"""A short Accelerate loop that ends the way scripts end: ``--ending`` says how.

* ``none``: the script just stops (no ``end_training``, no ``destroy_process_group``);
* ``close``: it calls ``model.close()`` (hf_elixir's runtime) and then stops;
* ``end_training``: Accelerate's ``end_training()`` (which destroys the process group).

Three optimizer steps leave the next pass's prefetched gathers in flight when the script
ends (the test pins an rCache smaller than the chunk count). Each rank prints a line when its
training is over, so the test can tell an abort at exit from one during training, and says
at the very end of its exit whether the process groups were left alive.
"""

import argparse
import atexit
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--ending", choices=["none", "close", "end_training"], default="none")
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()


def report_at_exit():
    """Registered before the accelerator, so it runs after every exit handler hf_elixir adds."""
    state = "alive" if dist.is_initialized() else "destroyed"
    print(f"rank {os.environ.get('RANK')} process groups at exit: {state}", flush=True)


atexit.register(report_at_exit)
accelerator = Accelerator()
torch.manual_seed(0)
config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
ids = torch.randint(0, 96, (32, 16), generator=torch.Generator().manual_seed(1))
loader = DataLoader(ids, batch_size=2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batches = iter(loader)
for _ in range(args.steps):
    x = next(batches)
    accelerator.backward(model(input_ids=x, labels=x).loss)
    optimizer.step()
    optimizer.zero_grad()
print(f"rank {accelerator.process_index} trained", flush=True)
if args.ending == "close":
    model.close()
elif args.ending == "end_training":
    accelerator.end_training()
