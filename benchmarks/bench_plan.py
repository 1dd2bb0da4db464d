"""How long planning takes: profile on the meta device plus the search, from configs alone.

    python benchmarks/bench_plan.py

Plans Llama-2-7B and Llama-2-13B (bf16 AdamW, batch 1 x 1024) for one 24 GB card and for
8 x 80 GB, three times each, and reports the median wall time (the issue's target: a 7B
config plans in under 20 s on a 2-core machine). Results: benchmarks/results/bench_plan.json.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import hf_elixir as hfe
from hf_elixir.profile.configs import known_config

RESULTS = Path(__file__).resolve().parent / "results" / "bench_plan.json"
CASES = [
    ("llama-2-7b", "rtx4090", 1),
    ("llama-2-7b", "a100-80g", 8),
    ("llama-2-13b", "rtx4090", 1),
    ("llama-2-13b", "a100-80g", 8),
]


def main() -> None:
    rows = []
    for model, hardware, gpus in CASES:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            try:
                plan = hfe.plan(known_config(model), (1, 1024), hardware=hardware, world_size=gpus, dtype="bf16")
                outcome = f"offload {plan.offload_fraction():.0%}, peak {plan.predictions['peak_bytes'] / 2**30:.1f} GiB"
            except hfe.PlanError as e:
                outcome = f"infeasible: {str(e)[:80]}"
            times.append(time.perf_counter() - t0)
        row = {"model": model, "hardware": hardware, "gpus": gpus,
               "median_s": statistics.median(times), "times_s": times, "plan": outcome}
        rows.append(row)
        print(f"{model:12s} {gpus} x {hardware:9s} {row['median_s']:6.2f} s   {outcome}", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
