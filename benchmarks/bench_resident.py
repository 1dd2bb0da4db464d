"""One rank, every chunk resident: hf_elixir's training step against plain PyTorch's.

    python benchmarks/bench_resident.py                  # three models, 20 timed steps each
    python benchmarks/bench_resident.py --quick          # a check that it runs, not a figure

When the whole model fits, hf_elixir's plan is ``ElixirPlan.simple(model, 1)``: one rank,
every chunk gathered in place, nothing offloaded. A step must then cost what plain
PyTorch's does (issue 36, build item 4): whatever the runtime does per module or per
parameter is pure overhead, and it shows most on a deep, narrow model, where each module's
compute is small (on a GPU every model is in that regime: kernels are fast, the host's
Python is not). So the models are a deep, narrow GPT-2 (48 layers, width 64), a Llama of
the same shape, and a shallow, wide GPT-2 (6 layers, width 512).

Both systems train the same model (a copy of one initialisation) on the same batches in
one process, fp32, AdamW with the fused kernel, clipping at 1.0, their steps alternated
(plain, hf_elixir, plain, ...) so that a change in the machine's speed hits both alike.
Each step is timed by phase (forward, backward, clip, optimizer step, zero_grad) with
``perf_counter``; the medians over the timed steps are reported, with hf_elixir's ratio to
plain PyTorch. The losses of every timed step are checked equal across the two systems.
Results go to benchmarks/results/bench_resident.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import hf_elixir as hfe  # noqa: E402
from bench_host_optimizer import machine, write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_resident.json"
PHASES = ("forward", "backward", "clip", "step", "zero_grad")
VOCAB = 512

#: name -> (family, layers, width, batch, sequence)
MODELS = {
    "gpt2-deep": ("gpt2", 48, 64, 4, 64),
    "llama-deep": ("llama", 48, 64, 4, 64),
    "gpt2-wide": ("gpt2", 6, 512, 4, 128),
}
QUICK = {"gpt2-deep": ("gpt2", 8, 32, 2, 16)}


def build(family: str, layers: int, width: int) -> torch.nn.Module:
    import transformers as tf

    if family == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=width, n_layer=layers, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=4 * width,
                                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                max_position_embeddings=256)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.float().train()


def step_fn(model: torch.nn.Module, optimizer, backward: Callable, clip: Callable,
            ids: torch.Tensor) -> Callable[[], tuple[float, list[float]]]:
    """One training step, returning its loss and the seconds of each phase."""

    def run() -> tuple[float, list[float]]:
        marks = [time.perf_counter()]
        loss = model(input_ids=ids, labels=ids).loss
        marks.append(time.perf_counter())
        backward(loss)
        marks.append(time.perf_counter())
        clip()
        marks.append(time.perf_counter())
        optimizer.step()
        marks.append(time.perf_counter())
        optimizer.zero_grad()
        marks.append(time.perf_counter())
        return float(loss.detach()), [b - a for a, b in zip(marks, marks[1:])]

    return run


def measure(name: str, spec: tuple, steps: int, warmup: int) -> dict:
    family, layers, width, batch, seq = spec
    model = build(family, layers, width)
    reference = copy.deepcopy(model)
    plain_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4, fused=True)
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1))
    eopt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(warmup + steps)]
    plain_clip = lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # noqa: E731
    times: dict[str, list[list[float]]] = {"plain": [], "hf_elixir": []}
    worst = 0.0
    for i, ids in enumerate(batches):
        plain_loss, plain_t = step_fn(reference, plain_opt, lambda loss: loss.backward(), plain_clip, ids)()
        ours_loss, ours_t = step_fn(emodel, eopt, eopt.backward, lambda: eopt.clip_grad_norm_(1.0), ids)()
        worst = max(worst, abs(plain_loss - ours_loss))
        if i >= warmup:
            times["plain"].append(plain_t)
            times["hf_elixir"].append(ours_t)
    emodel.close()
    if worst > 1e-4:
        raise SystemExit(f"{name}: the losses parted by {worst:.3g}; the systems did not train alike")
    row: dict = {"model": name, "layers": layers, "width": width, "batch": [batch, seq],
                 "parameters": sum(p.numel() for p in reference.parameters()),
                 "max_loss_difference": worst, "steps": steps}
    for system, rows in times.items():
        row[system] = {"step_s": statistics.median(sum(r) for r in rows),
                       **{phase: statistics.median(r[i] for r in rows) for i, phase in enumerate(PHASES)}}
    row["ratio"] = row["hf_elixir"]["step_s"] / row["plain"]["step_s"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one small model, 3 steps (a check, not a figure)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    models = {m: MODELS[m] for m in args.models}
    if args.quick:
        models, args.steps, args.warmup = QUICK, 3, 1
    rows = []
    for name, spec in models.items():
        row = measure(name, spec, args.steps, args.warmup)
        rows.append(row)
        phases = ", ".join(f"{ph} {1e3 * row['plain'][ph]:.1f}/{1e3 * row['hf_elixir'][ph]:.1f}" for ph in PHASES)
        print(f"{name}: plain {1e3 * row['plain']['step_s']:.1f} ms, hf_elixir "
              f"{1e3 * row['hf_elixir']['step_s']:.1f} ms, {row['ratio']:.3f}x (ms plain/hf_elixir: {phases})",
              flush=True)
    write_results(args.out, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
