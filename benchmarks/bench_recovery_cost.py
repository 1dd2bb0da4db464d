"""What out-of-memory recovery costs a training step that does not fail, paired in one run.

    python benchmarks/bench_recovery_cost.py                     # three models, 2 x 24 pairs each
    python benchmarks/bench_recovery_cost.py --models gpt2-30m --pairs 4

Recovery (runtime/recovery.py) rides every healthy step: each training forward's inputs are
recorded, the loss handed to backward is linked to the model's loss, and every collective
of a pass is recorded into its schedule (runtime/schedule.py). With ``recover_oom=False``
the runtime does none of it. This script measures the difference where bench_step.py
cannot: this VM's speed drifts by 10-40% within minutes, far more than the cost in
question, so medians of separate runs (bench_step's ratios from one day to the next) move
more than any change in the runtime.

The two runtimes train the same model (bench_step's setup, the three bench_planner models,
world size 2 on CPU over gloo, global batch 4 x 128, fp32, AdamW, clipping at 1.0) in the
same two ranks, built side by side, and take their steps alternately (the order swapped
every pair), each step between barriers, so that both see the same drift. Per model it
reports each runtime's median step, the paired relative differences (with recovery over
without, minus one), their median and a bootstrap 90% interval of that median, and checks
that both runtimes computed the same losses (recovery must not change a healthy step).
``--control`` builds both runtimes without recovery (an A/A run): whatever "change" it
reports is the harness's own bias and spread, the floor under which a change means nothing.

The order the two runtimes are built in moves their step times by a few per cent (heap
layout; measured +5.5% one way and +1.9% the other on GPT-2 30M), so each model runs in two
blocks: one with the recovering runtime built first, one with it built second; their pairs
are pooled.

The wall-clock difference rests on noisy steps. Beside it, the time spent inside recovery's
own code per step (``direct_ms_per_step``) is measured after the timed pairs, in
``--direct-steps`` more steps of the recovering runtime with its recovery methods timed:
recording each forward's inputs and start state, linking the loss, ending a pass's schedule,
recording every collective, and forgetting the step's records.
Results: benchmarks/results/bench_recovery_cost.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from bench_planner import MODELS, build
from bench_step import (RESULTS, add_host_memory_option, apply_host_memory_setting, batch_for, launch, setup_elixir,
                        timed_step)

ARMS = {"with_recovery": True, "without_recovery": False}


def paired_block(args, model_name: str, build_order: list[str]) -> dict:
    """Both runtimes on one model, built in ``build_order`` and stepped alternately: their
    step times and losses, and the recovering runtime's direct cost after them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    recover = {arm: ARMS[arm] and not args.control for arm in ARMS}
    steps = {arm: setup_elixir(build(model_name), recover_oom=recover[arm])[0] for arm in build_order}
    vocab = build(model_name).config.vocab_size
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    losses: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(args.warmup + args.pairs):
        ids = batch_for(rank, world, i, args.global_batch, args.seq_len, vocab)
        for arm in (list(ARMS) if i % 2 == 0 else list(reversed(ARMS))):
            elapsed, loss = timed_step(steps[arm], ids)
            losses[arm].append(loss)
            if i >= args.warmup:
                times[arm].append(elapsed)
    spent: list[float] = []
    with recovery_code_timed(spent):
        for i in range(args.direct_steps):
            ids = batch_for(rank, world, args.warmup + args.pairs + i, args.global_batch, args.seq_len, vocab)
            timed_step(steps["with_recovery"], ids)
    del steps
    return {"build_order": build_order, "step_times_s": times, "losses": losses,
            "direct_ms_per_step": 1e3 * sum(spent) / max(1, args.direct_steps)}


@contextlib.contextmanager
def recovery_code_timed(spent: list[float]) -> Iterator[None]:
    """Time every call into recovery's per-step code (appended to ``spent``, in seconds): a
    training forward's recording (not the model's forward itself), the loss link before
    backward, the end of a pass's schedule, each collective's record and wait, the step's
    reset."""
    from hf_elixir.runtime.comm import Collectives
    from hf_elixir.runtime.recovery import Recovery
    from hf_elixir.runtime.schedule import Schedule

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent.append(time.perf_counter() - t0)
        return wrapper

    run_forward = Recovery.run_forward

    def forward_recording(self, call, args, kwargs):
        inner = [0.0]

        def model_forward():
            t0 = time.perf_counter()
            try:
                return call()
            finally:
                inner[0] += time.perf_counter() - t0

        t0 = time.perf_counter()
        try:
            return run_forward(self, model_forward, args, kwargs)
        finally:
            spent.append(time.perf_counter() - t0 - inner[0])

    patched = {(Recovery, "run_forward"): forward_recording}
    for owner, name in ((Recovery, "before_backward"), (Recovery, "after_backward"), (Recovery, "stepped"),
                        (Collectives, "_record"), (Schedule, "waited")):
        patched[(owner, name)] = timed(getattr(owner, name))
    originals = {key: getattr(*key) for key in patched}
    try:
        for (owner, name), fn in patched.items():
            setattr(owner, name, fn)
        yield
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)


def pooled(blocks: list[dict], arms) -> dict:
    """Blocks of paired steps, with each arm's step times and losses pooled over them."""
    return {"blocks": blocks,
            "step_times_s": {arm: [t for b in blocks for t in b["step_times_s"][arm]] for arm in arms},
            "losses": {arm: [v for b in blocks for v in b["losses"][arm]] for arm in arms}}


def paired_steps(args, model_name: str) -> dict:
    """Two blocks (the recovering runtime built first, then second), their pairs pooled."""
    blocks = [paired_block(args, model_name, order) for order in (list(ARMS), list(reversed(ARMS)))]
    return {**pooled(blocks, ARMS), "direct_ms_per_step": statistics.mean(b["direct_ms_per_step"] for b in blocks)}


def paired_worker(rank: int, world: int, port: int, args, queue, per_model, arms) -> None:
    """One rank of a paired run over gloo: ``per_model(args, model_name)`` for each model
    (its pooled blocks); rank 0 prints each arm's median step and puts the results on
    ``queue``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads))
    apply_host_memory_setting(args)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for model_name in args.models:
        results[model_name] = per_model(args, model_name)
        if rank == 0:
            t = results[model_name]["step_times_s"]
            print(f"{model_name:10s} median step: " + ", ".join(f"{arm} {statistics.median(t[arm]):.3f} s"
                                                                 for arm in arms), flush=True)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def worker(rank: int, world: int, port: int, args, queue, systems=None) -> None:
    paired_worker(rank, world, port, args, queue, paired_steps, ARMS)


def bootstrap_median(values: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% percentile-bootstrap interval of the median of ``values``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.05 * rounds)], medians[int(0.95 * rounds) - 1]


def summarise(results: dict) -> dict:
    summary = {}
    for model_name, res in results.items():
        with_, without = res["step_times_s"]["with_recovery"], res["step_times_s"]["without_recovery"]
        change = [a / b - 1 for a, b in zip(with_, without)]
        low, high = bootstrap_median(change)
        block_change = [statistics.median(a / b - 1 for a, b in zip(blk["step_times_s"]["with_recovery"],
                                                                  blk["step_times_s"]["without_recovery"]))
                        for blk in res["blocks"]]
        la, lb = res["losses"]["with_recovery"], res["losses"]["without_recovery"]
        summary[model_name] = {
            "median_step_s": {"with_recovery": statistics.median(with_), "without_recovery": statistics.median(without)},
            "ratio_of_medians": statistics.median(with_) / statistics.median(without),
            "paired_median_change": statistics.median(change),
            "paired_median_change_90ci": [low, high],
            "paired_median_change_by_build_order": {"recovering_built_first": block_change[0],
                                                    "recovering_built_second": block_change[1]},
            "pairs": len(change),
            "direct_ms_per_step": res["direct_ms_per_step"],
            "direct_share_of_step": res["direct_ms_per_step"] / 1e3 / statistics.median(with_),
            "losses_equal": all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(la, lb)),
        }
    return summary


def add_paired_options(p: argparse.ArgumentParser) -> None:
    """The options of a paired run: its models, ranks, batch, pairs and threads, and the
    allocator setting every arm shares."""
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pairs", type=int, default=24, help="timed steps of each runtime per block (two blocks)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    add_host_memory_option(p)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_paired_options(p)
    p.add_argument("--direct-steps", type=int, default=4, help="steps with recovery's own code timed")
    p.add_argument("--control", action="store_true",
                   help="an A/A run: both runtimes without recovery, to show the harness's own spread")
    p.add_argument("--output", type=Path, default=None,
                   help="default: results/bench_recovery_cost.json (bench_recovery_cost_control.json with --control)")
    args = p.parse_args()
    if args.output is None:
        args.output = RESULTS / ("bench_recovery_cost_control.json" if args.control else "bench_recovery_cost.json")
    if args.global_batch % args.world_size:
        p.error("--global-batch must be divisible by --world-size")
    results = launch(args, target=worker)
    summary = summarise(results)
    record = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "torch": torch.__version__, "summary": summary, "raw": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1))
    if args.control:
        print("\ncontrol run: both runtimes are without recovery; the columns keep their names")
    print(f"\n{'model':10s} {'with s':>8s} {'without s':>9s} {'paired change':>14s} {'90% interval':>18s} "
          f"{'in recovery code':>17s} losses")
    for model_name, row in summary.items():
        low, high = row["paired_median_change_90ci"]
        print(f"{model_name:10s} {row['median_step_s']['with_recovery']:8.3f} "
              f"{row['median_step_s']['without_recovery']:9.3f} {row['paired_median_change']:+14.2%} "
              f"{f'[{low:+.2%}, {high:+.2%}]':>18s} "
              f"{row['direct_ms_per_step']:6.2f} ms ({row['direct_share_of_step']:.2%}) "
              f"{'equal' if row['losses_equal'] else 'DIFFER'}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
