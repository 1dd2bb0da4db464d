"""A plain torch.distributed script whose gloo threads outlive its process groups.

A DDP model holds the default group, so ``destroy_process_group()`` at exit cannot join the
group's worker threads; the script then ends with an all-gather still in flight whose
tensors it no longer references, so a worker thread frees their Python objects whenever it
finishes: during the interpreter's teardown, that aborts the process (process_exit.py). Each
rank prints a line once its work is done; ``--ending`` says how the script then ends.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--ending", choices=["normal", "exit3", "message", "error"], default="normal")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(4, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.all_gather([torch.empty(1 << 16) for _ in range(dist.get_world_size())], torch.full((1 << 16,), float(rank)),
                async_op=True)  # in flight at exit; nothing here keeps its tensors
print(f"rank {rank} done (local rank {os.environ.get('LOCAL_RANK')})", flush=True)
if args.ending == "exit3":
    sys.exit(3)
if args.ending == "message":
    raise SystemExit("ending with a message")
if args.ending == "error":
    raise RuntimeError("ending with an error")
