"""How long planning takes: profile on the meta device plus the search, from configs alone.

    python benchmarks/bench_plan.py            # everything (about 4 minutes on 2 cores)
    python benchmarks/bench_plan.py --quick    # one repeat, no unfolded baseline

Two kinds of rows, three repeats each (median reported):

- ``in_process``: ``hfe.plan(config)`` for Llama-2 7B and 13B (bf16 AdamW, batch 1 x 1024)
  on one 24 GB card and on 8 x 80 GB, in a process that has imported everything: what a
  launch pays for ``plan: auto``, from a cold start (the meta kernels' remembered outputs
  cleared before each). Each is also planned the way it was before folding (``fold=False``:
  every layer traced, every meta kernel run), and the two plans must agree.
- ``cli``: the ``hf-elixir plan`` command as a user runs it, in a fresh process, imports
  included: Llama-2 70B QLoRA on 2 x rtx4090 (issue 37's target: under 10 s), and Llama-2 7B
  with LoRA and in full on one rtx4090.

Results: benchmarks/results/bench_plan.json, with the machine's load average at the start of
each row (on a loaded machine the times are not this machine's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import hf_elixir as hfe
from hf_elixir.profile.configs import known_config
from hf_elixir.profile.memory import META_KERNELS
from hf_elixir.profile.profiler import profile_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_plan.json"
IN_PROCESS = [
    ("llama-2-7b", "rtx4090", 1),
    ("llama-2-7b", "a100-80g", 8),
    ("llama-2-13b", "rtx4090", 1),
    ("llama-2-13b", "a100-80g", 8),
]
CLI = [
    ("llama-2-70b QLoRA r16", ["meta-llama/Llama-2-70b-hf", "--load-in-4bit", "--lora-r", "16", "--gpus", "2",
                               "--hardware", "rtx4090"]),
    ("llama-2-7b LoRA r16", ["meta-llama/Llama-2-7b-hf", "--lora-r", "16", "--gpus", "1", "--hardware", "rtx4090"]),
    ("llama-2-7b", ["meta-llama/Llama-2-7b-hf", "--gpus", "1", "--hardware", "rtx4090"]),
]


def _outcome(plan) -> str:
    return (f"step {plan.predictions['step_time_s']:.3f} s, offload {plan.offload_fraction():.0%}, "
            f"peak {plan.predictions['peak_bytes'] / 2**30:.2f} GiB")


def _plan(model: str, hardware: str, gpus: int, fold: bool):
    """One plan from a cold start: the meta kernels' outputs forgotten first. ``fold=False``
    is the baseline before this work: every layer traced and every meta kernel run."""
    config = known_config(model)
    META_KERNELS.clear()
    META_KERNELS.enabled = fold
    t0 = time.perf_counter()
    try:
        profile = profile_model(config, (1, 1024), dtype="bf16", attention_target="cuda", fold=fold)
    finally:
        META_KERNELS.enabled = True
    try:
        plan = hfe.plan(config, (1, 1024), hardware=hardware, world_size=gpus, dtype="bf16", profile=profile)
        outcome = _outcome(plan)
    except hfe.PlanError as e:
        outcome = f"infeasible: {str(e)[:80]}"
    return time.perf_counter() - t0, outcome, profile.seconds


def in_process(repeats: int, baseline: bool) -> list[dict]:
    rows = []
    for model, hardware, gpus in IN_PROCESS:
        load = os.getloadavg()[0]
        folded = [_plan(model, hardware, gpus, fold=True) for _ in range(repeats)]
        row = {"kind": "in_process", "model": model, "hardware": hardware, "gpus": gpus, "load_at_start": load,
               "median_s": statistics.median(t for t, _, _ in folded), "times_s": [t for t, _, _ in folded],
               "profile_s": [p for _, _, p in folded], "plan": folded[0][1]}
        if baseline:
            full = [_plan(model, hardware, gpus, fold=False) for _ in range(repeats)]
            row.update(unfolded_median_s=statistics.median(t for t, _, _ in full),
                       unfolded_times_s=[t for t, _, _ in full], unfolded_plan=full[0][1],
                       same_plan=full[0][1] == folded[0][1])
        rows.append(row)
        extra = (f"   every layer traced: {row['unfolded_median_s']:6.2f} s, same plan: {row['same_plan']}"
                 if baseline else "")
        print(f"{model:12s} {gpus} x {hardware:9s} {row['median_s']:6.2f} s   {row['plan']}{extra}", flush=True)
    return rows


def cli(repeats: int) -> list[dict]:
    rows = []
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for label, args in CLI:
        load = os.getloadavg()[0]
        times, last = [], ""
        for _ in range(repeats):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "hf_elixir.cli", "plan", *args], capture_output=True,
                                  text=True, env=env)
            times.append(time.perf_counter() - t0)
            if done.returncode != 0:
                raise SystemExit(f"hf-elixir plan {' '.join(args)} failed:\n{done.stderr[-2000:]}")
            last = done.stdout
        chosen = next((line.strip() for line in last.splitlines() if line.strip().startswith("chosen")), "")
        row = {"kind": "cli", "model": label, "command": "hf-elixir plan " + " ".join(args), "load_at_start": load,
               "median_s": statistics.median(times), "times_s": times, "plan": " ".join(chosen.split())}
        rows.append(row)
        print(f"hf-elixir plan {label:24s} {row['median_s']:6.2f} s   {row['plan'][:110]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat, no baseline with every layer traced")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    rows = cli(repeats) + in_process(repeats, baseline=not args.quick)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
