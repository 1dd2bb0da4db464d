"""Trains until killed; each rank records its pid in ``--pids`` (for the worker-loss test)."""

import argparse
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--pids", required=True)
args = p.parse_args()
accelerator = Accelerator()
model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
Path(args.pids, f"rank{accelerator.process_index}").write_text(str(os.getpid()))
ids = torch.randint(0, 96, (2, 16))
while True:
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
