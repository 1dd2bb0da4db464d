"""The bare runtime, without Accelerate or the Trainer: a small training loop on local processes.

    torchrun --nproc_per_node 2 examples/finetune_demo.py

Builds a small GPT-2 from a config (no download), tokenizes the bundled corpus with a
character-level vocabulary, shards the model over the ranks with hf_elixir, trains with
AdamW, warm-up, clipping and gradient accumulation, and prints the loss, the throughput,
the runtime's device memory by category and a greedy sample, then saves a sharded
checkpoint and exports it to a folder that ``from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import hf_elixir as hfe
from hf_elixir import checkpoint

CORPUS = Path(__file__).parent / "data" / "tiny_corpus.txt"


class CharTokenizer:
    """Characters of the corpus are the vocabulary; id 0 is padding."""

    def __init__(self, text: str) -> None:
        self.chars = ["<pad>"] + sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in text if c in self.index]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids if i > 0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--memory-budget", default="24MiB",
                   help="device memory per rank the planner may use (small, to make it offload)")
    p.add_argument("--output", type=Path, default=Path("out/demo"),
                   help="where the sharded checkpoint (ckpt/) and the exported model (model/) go")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)

    text = CORPUS.read_text()
    tok = CharTokenizer(text)
    data = torch.tensor(tok.encode(text))
    config = GPT2Config(vocab_size=len(tok.chars), n_positions=args.seq_len, n_embd=128, n_layer=4,
                        n_head=4, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())  # before wrapping releases them
    micro = args.batch_size // args.accumulation // world
    if micro < 1:
        raise SystemExit("--batch-size must be at least accumulation x world size")
    # the planner profiles the model on the meta device and picks the fastest plan that fits
    plan = hfe.plan(model, (micro, args.seq_len), hardware="cpu", world_size=world, dtype=args.dtype,
                    memory_budget=args.memory_budget)
    emodel = hfe.ElixirModule(model, plan)
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=args.steps // 10, num_training_steps=args.steps)
    if rank == 0:
        print(f"GPT-2 with {n_params / 1e6:.2f}M parameters on {world} rank(s)")
        print(plan.summary())

    gen = torch.Generator().manual_seed(1234)
    emodel.train()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        # every rank draws the same global batch and takes its own rows
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + args.seq_len] for s in starts])
        total = torch.zeros(1)
        for m in range(args.accumulation):
            rows = batch[(m * world + rank) * micro : (m * world + rank + 1) * micro]
            loss = emodel(input_ids=rows, labels=rows).loss / args.accumulation
            opt.backward(loss)
            total += loss.detach()
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total)
        if rank == 0 and (step % 10 == 0 or step == 1):
            elapsed = time.perf_counter() - start
            tokens = step * args.batch_size * args.seq_len
            print(f"step {step:4d}  loss {total.item() / world:.4f}  grad-norm {norm.item():.3f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {tokens / elapsed:,.0f} tokens/s", flush=True)

    report = emodel.memory_report()
    emodel.eval()
    prompt = torch.tensor([tok.encode("The ")])
    sample = emodel.generate(prompt, max_new_tokens=60, do_sample=False, pad_token_id=0)
    if rank == 0:
        peak = {k: f"{v / 2**20:.2f} MiB" for k, v in report["peak"].items() if v}
        print("runtime device memory at peak:", peak)
        print("sample:", repr(tok.decode(sample[0].tolist())))

    # a sharded checkpoint (every rank writes its own shards), then one from_pretrained folder
    ckpt = checkpoint.save(emodel, opt, args.output / "ckpt", scheduler=sched)
    if rank == 0:
        checkpoint.export(ckpt, args.output / "model")
        again = GPT2LMHeadModel.from_pretrained(args.output / "model").eval()
        with torch.no_grad():
            same = again.generate(prompt, max_new_tokens=60, do_sample=False, pad_token_id=0)
        print(f"checkpoint: {ckpt}; exported model: {args.output / 'model'} "
              f"(from_pretrained gives the same sample: {torch.equal(same, sample)})")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
