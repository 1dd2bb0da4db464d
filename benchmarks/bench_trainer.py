"""A stock Trainer script, plain and under ``hf-elixir launch`` with nothing offloaded.

    python benchmarks/bench_trainer.py                # fp32 and bf16, 3 rounds each
    python benchmarks/bench_trainer.py --quick        # a check that it runs, not a figure

Issue 36 asks that hf_elixir, with the whole model on one device, cost a Trainer user
nothing: at least 0.95x the plain Trainer's tokens/s on a GPU (the GPU suite's ``trainer``
section). This runs the same two commands on this machine's CPU: ``trainer_speed.py``
started plainly, then under ``hf-elixir launch`` with a one-process config (offload
``none``), each command through ``gpu_suite_jobs.run_trainer``, as the suite starts them.
The model is a GPT-2 small enough that a step takes tens of milliseconds, where work done
per module, per parameter or per step outside the model would show.

The two commands alternate, the first of each round swapped every round, so that a drift of
the machine's speed hits both alike. Both run with the machine's cores as threads: the plain
command by torch's default, the launched worker because the launcher gives a lone CPU
process every core. Each run's median step comes from the script's own per-step timer
after its warm-up steps; the ratio is hf_elixir's tokens/s over the plain Trainer's in the
same round. Results go to benchmarks/results/bench_trainer.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_host_optimizer import machine, write_results  # noqa: E402
from gpu_suite_jobs import run_trainer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_trainer.json"


def job(launcher: str, dtype: str, args: argparse.Namespace) -> dict:
    """One ``run_trainer`` job on the CPU (the GPU suite's job format)."""
    model = {"name": f"gpt2-{args.layers}x{args.width}",
             "kwargs": {"n_layer": args.layers, "n_embd": args.width, "n_head": args.heads, "vocab_size": args.vocab}}
    return {"model": model, "seq": args.seq, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
            "dtype": dtype, "device": "cpu", "launcher": launcher, "offload": "none"}


def one_round(dtype: str, plain_first: bool, args: argparse.Namespace) -> dict:
    order = ["plain", "hf_elixir"] if plain_first else ["hf_elixir", "plain"]
    runs = {}
    for launcher in order:
        result = run_trainer(job(launcher, dtype, args))
        if result.get("status") != "ok":
            raise SystemExit(f"{launcher} ({dtype}) failed: {result.get('error')}\n{result.get('stderr', '')}")
        runs[launcher] = result
    plain, elixir = runs["plain"], runs["hf_elixir"]
    return {
        "first": order[0],
        "median_step_s": {"plain": plain["median_step_s"], "hf_elixir": elixir["median_step_s"]},
        "tokens_per_s": {"plain": plain["tokens_per_s"], "hf_elixir": elixir["tokens_per_s"]},
        "vs_plain": elixir["tokens_per_s"] / plain["tokens_per_s"],
        "trainers": {"plain": plain.get("trainer"), "hf_elixir": elixir.get("trainer")},
        "hf_elixir_breakdown": elixir.get("time_report"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="timed steps of each run")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps of each run")
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 round, a few steps: it runs, nothing more")
    p.add_argument("--out", type=Path, default=None, help=f"results file (default {RESULTS}; --quick: none)")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.layers, args.width, args.vocab, args.seq, args.batch = 1, 2, 32, 128, 16, 2
        args.steps, args.warmup = 3, 1
    results = {"machine": machine(), "config": {k: v for k, v in vars(args).items() if k != "out"}, "dtypes": {}}
    for dtype in args.dtypes:
        rounds = [one_round(dtype, i % 2 == 0, args) for i in range(args.rounds)]
        ratios = [r["vs_plain"] for r in rounds]
        results["dtypes"][dtype] = {"vs_plain": ratios, "median_vs_plain": statistics.median(ratios), "rounds": rounds}
        steps = ", ".join(f"{r['median_step_s']['plain'] * 1e3:.1f}/{r['median_step_s']['hf_elixir'] * 1e3:.1f}"
                          for r in rounds)
        print(f"{dtype}: hf_elixir vs the plain Trainer (tokens/s) {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"steps plain/hf_elixir ms {steps}")
    out = args.out or (None if args.quick else RESULTS)
    if out is not None:
        write_results(out, results)


if __name__ == "__main__":
    main()
