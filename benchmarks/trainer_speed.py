"""A stock Transformers Trainer script that times its own steps (the GPU suite's ``trainer``
section starts it plainly and under ``hf-elixir launch``).

    python benchmarks/trainer_speed.py --out plain.json --bf16 true
    hf-elixir launch --config_file elixir.yaml benchmarks/trainer_speed.py --out elixir.json --bf16 true

Standard imports only, as a user's script would have: a GPT-2 built from its config (GPT-2
124M by default), random tokens, ``Trainer`` with the usual arguments. A callback times each
optimizer step (the device synchronised at both ends, so a step's time is its work, not its
launch). Rank 0 writes the median step after the warm-up steps, tokens per second, which
trainer ran (``hf-elixir launch`` hands the script hf_elixir's), whether compile was asked
for (``--torch_compile true``) and dynamo's counters (frames compiled, graphs, recompiles: that
compile really ran) and, where the trained model has one, its step breakdown
(``time_report()``), to ``--out``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainerCallback,
                          TrainingArguments)


@dataclass
class SpeedArguments:
    out: str = field(default="trainer_speed.json", metadata={"help": "where rank 0 writes the result"})
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50257
    seq: int = 512
    timed_steps: int = 40
    untimed_steps: int = 10  # first steps, left out of the median (warm-up)


class Tokens(torch.utils.data.Dataset):
    """Random tokens, the same on every rank and every run."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, the device synchronised at its start and end."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.times.append(time.perf_counter() - self._start)


def dynamo_counts() -> dict:
    """Dynamo's counters in this process: frames it compiled, distinct graphs, recompiles
    (all zero when nothing was compiled)."""
    from torch._dynamo.utils import counters

    return {"frames_ok": counters["frames"]["ok"], "unique_graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values())}


def main() -> None:
    speed, args = HfArgumentParser((SpeedArguments, TrainingArguments)).parse_args_into_dataclasses(
        args=None, look_for_args_file=False)
    steps = speed.untimed_steps + speed.timed_steps
    args.max_steps = steps
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=speed.vocab, n_positions=max(1024, speed.seq), n_embd=speed.width,
                        n_layer=speed.layers, n_head=speed.heads, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = Tokens(args.per_device_train_batch_size * world * steps, speed.seq, speed.vocab)
    timer = StepTimer()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
    trainer.train()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    timed = timer.times[speed.untimed_steps:] or timer.times
    median = statistics.median(timed)
    tokens = args.per_device_train_batch_size * world * speed.seq
    wrapped = getattr(trainer, "model_wrapped", None)
    result = {"trainer": type(trainer).__name__, "world": world, "bf16": bool(args.bf16),
              "device": str(args.device), "parameters": sum(p.numel() for p in model.parameters()),
              "batch": args.per_device_train_batch_size, "seq": speed.seq, "step_times_s": timer.times,
              "median_step_s": median, "tokens_per_s": tokens / median,
              "torch_compile": bool(args.torch_compile), "dynamo": dynamo_counts(),
              "time_report": wrapped.time_report() if hasattr(wrapped, "time_report") else None}
    with open(speed.out, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "--output_dir" not in sys.argv:  # nothing is saved; the Trainer still wants a folder
        sys.argv += ["--output_dir", tempfile.mkdtemp(prefix="trainer_speed_")]
    main()
