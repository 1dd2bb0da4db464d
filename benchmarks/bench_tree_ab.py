"""Has a change made training slower? This tree's runtime against an earlier revision's, paired.

    python benchmarks/bench_tree_ab.py --base c12e827                 # three models, 2 x 24 pairs
    python benchmarks/bench_tree_ab.py --base c12e827 --models gpt2-30m --pairs 8
    python benchmarks/bench_tree_ab.py --base HEAD                    # an A/A control
    python benchmarks/bench_tree_ab.py --base c12e827 --offload 1     # every chunk's optimizer on the host

bench_step.py's ratios to DDP and FSDP2 move by 10-40% from one run to the next on this VM
(its speed drifts within minutes), far more than the few per cent a regression costs, so
two separate runs of it cannot say whether a change slowed the runtime down. This script
asks the question where the drift cancels: both runtimes train the same model in the same
two ranks (bench_step's setup: world size 2 on CPU over gloo, the bench_planner models,
global batch 4 x 128, fp32, AdamW, clipping at 1.0, ``ElixirPlan.simple`` with
bench_step's chunking; ``--offload F``: the optimizer state of that fraction of the chunks
on the host, updated behind the next forward), built side by side and stepped alternately, each step between
barriers, the order swapped every pair, as ``bench_recovery_cost.py`` pairs recovery with
none. Each model runs in two blocks, this tree's runtime built first in one and second in
the other (the build order alone moves step times by a few per cent), and the pairs are
pooled.

The earlier revision is the package as committed at ``--base`` (``git archive``), copied
into a scratch folder under the name ``hf_elixir_base`` (its imports of itself renamed),
so that both import side by side in one process. Only the runtime differs: the models,
batches, plan arguments and timing are this script's.

Per model it reports each runtime's median step, the paired relative change (this tree
over the base, minus one), its median with a bootstrap 90% interval, and whether the two
computed the same losses. ``--base HEAD`` on a clean tree is an A/A run: the change it
reports is the harness's own bias and spread, the floor under which a change means
nothing. Results: benchmarks/results/bench_tree_ab.json (``--output`` to change).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import torch
import torch.distributed as dist

from bench_planner import build
from bench_recovery_cost import add_paired_options, bootstrap_median, paired_worker, pooled
from bench_step import PACK_SIZE, RESULTS, batch_for, elixir_step, launch, timed_step

ROOT = Path(__file__).resolve().parent.parent
BASE_PACKAGE = "hf_elixir_base"
ARMS = ("this_tree", "base")
_SELF_NAME = re.compile(r"\bhf_elixir\b")


def materialize_base(revision: str, into: Path, repo: Path = ROOT) -> str:
    """Write the package as committed at ``revision`` of ``repo`` into ``into``/hf_elixir_base,
    its references to its own name renamed; returns the revision's full hash."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=repo,
                            capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"--base {revision!r} is not a commit of this repository: {commit.stderr.strip()}")
    archive = subprocess.run(["git", "archive", "--format=tar", commit.stdout.strip(), "hf_elixir"], cwd=repo,
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "hf_elixir").rename(into / BASE_PACKAGE)
    for path in (into / BASE_PACKAGE).rglob("*.py"):
        path.write_text(_SELF_NAME.sub(BASE_PACKAGE, path.read_text()))
    return commit.stdout.strip()


def setup_arm(package: str, model, offload: float = 0.0):
    """A step function of ``package``'s runtime over ``model`` (bench_step's hf_elixir setup,
    with ``offload`` of the chunks' optimizer state on the host)."""
    hfe = importlib.import_module(package)
    largest = max(p.numel() for p in model.parameters())
    plan = hfe.ElixirPlan.simple(model, dist.get_world_size(), chunk_size=largest, rcache_blocks=None,
                                 pack_size=PACK_SIZE, offload_fraction=offload)
    em = hfe.ElixirModule(model, plan)
    return elixir_step(em, hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-4)))


def paired_block(args, model_name: str, build_order: tuple[str, ...]) -> dict:
    """Both runtimes on one model, built in ``build_order`` and stepped alternately."""
    rank, world = dist.get_rank(), dist.get_world_size()
    package = {"this_tree": "hf_elixir", "base": BASE_PACKAGE}
    steps = {arm: setup_arm(package[arm], build(model_name), args.offload) for arm in build_order}
    vocab = build(model_name).config.vocab_size
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    losses: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(args.warmup + args.pairs):
        ids = batch_for(rank, world, i, args.global_batch, args.seq_len, vocab)
        for arm in (ARMS if i % 2 == 0 else tuple(reversed(ARMS))):
            elapsed, loss = timed_step(steps[arm], ids)
            losses[arm].append(loss)
            if i >= args.warmup:
                times[arm].append(elapsed)
    del steps
    return {"build_order": list(build_order), "step_times_s": times, "losses": losses}


def paired_steps(args, model_name: str) -> dict:
    """Two blocks (this tree's runtime built first, then second), their pairs pooled."""
    return pooled([paired_block(args, model_name, order) for order in (ARMS, tuple(reversed(ARMS)))], ARMS)


def worker(rank: int, world: int, port: int, args, queue, systems=None) -> None:
    sys.path.insert(0, args.base_dir)  # the base revision imports from its scratch folder
    paired_worker(rank, world, port, args, queue, paired_steps, ARMS)


def summarise(results: dict) -> dict:
    summary = {}
    for model_name, res in results.items():
        this, base = res["step_times_s"]["this_tree"], res["step_times_s"]["base"]
        change = [a / b - 1 for a, b in zip(this, base)]
        low, high = bootstrap_median(change)
        la, lb = res["losses"]["this_tree"], res["losses"]["base"]
        summary[model_name] = {
            "median_step_s": {"this_tree": statistics.median(this), "base": statistics.median(base)},
            "paired_median_change": statistics.median(change),
            "paired_median_change_90ci": [low, high],
            "paired_median_change_by_build_order": {
                "this_tree_built_first": statistics.median(
                    a / b - 1 for a, b in zip(*(res["blocks"][0]["step_times_s"][arm] for arm in ARMS))),
                "this_tree_built_second": statistics.median(
                    a / b - 1 for a, b in zip(*(res["blocks"][1]["step_times_s"][arm] for arm in ARMS)))},
            "pairs": len(change),
            "max_relative_loss_difference": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(la, lb)),
        }
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the revision to compare against (a commit, tag or branch)")
    add_paired_options(p)
    p.add_argument("--offload", type=float, default=0.0,
                   help="the fraction of the chunks whose optimizer state is on the host (0 to 1)")
    p.add_argument("--output", type=Path, default=RESULTS / "bench_tree_ab.json")
    args = p.parse_args()
    if args.global_batch % args.world_size:
        p.error("--global-batch must be divisible by --world-size")
    if not 0.0 <= args.offload <= 1.0:
        p.error("--offload is a fraction of the chunks, from 0 to 1")
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hf_elixir"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="hf_elixir_base_") as scratch:
        base_commit = materialize_base(args.base, Path(scratch))
        args.base_dir = scratch
        results = launch(args, target=worker)
    summary = summarise(results)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "base_dir"},
              "this_tree": {"head": head, "uncommitted_changes_in_package": bool(dirty)},
              "base_commit": base_commit, "torch": torch.__version__, "summary": summary, "raw": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1))
    print(f"\nthis tree (HEAD {head[:9]}{', with uncommitted changes' if dirty else ''}) against {base_commit[:9]}")
    print(f"{'model':10s} {'this s':>8s} {'base s':>8s} {'paired change':>14s} {'90% interval':>18s} losses")
    for model_name, row in summary.items():
        low, high = row["paired_median_change_90ci"]
        print(f"{model_name:10s} {row['median_step_s']['this_tree']:8.3f} {row['median_step_s']['base']:8.3f} "
              f"{row['paired_median_change']:+14.2%} {f'[{low:+.2%}, {high:+.2%}]':>18s} "
              f"max relative difference {row['max_relative_loss_difference']:.1e}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
