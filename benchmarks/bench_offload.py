"""Training-step time with optimizer state offloaded to the CPU: hf_elixir against FSDP2 and
DeepSpeed ZeRO-3, each with and without offload, in one run.

    python benchmarks/bench_offload.py                    # both GPT-2 sizes, world size 2
    python benchmarks/bench_offload.py --models gpt2-30m --steps 3
    pip install torch==2.13.0 -e .[bench]                 # DeepSpeed for its two systems (CPU torch kept)

Every system trains the same GPT-2 (same seed, same data) on CPU over gloo, as in
bench_step.py (whose helpers this script uses): global batch 4, sequence 128, fp32, AdamW
(lr 1e-4, weight decay 0.01), clipping at 1.0, warm-up steps then the median of the timed
steps; the losses of the first steps are checked equal across systems.

Systems (the AdamW implementation each uses is recorded in the results):

- hf_elixir_offload       ElixirPlan.simple(..., offload_fraction=1.0): all optimizer state on
                          the CPU; torch AdamW, fused kernel, on the flat shards
- hf_elixir_offload_half  the same with offload_fraction=0.5
- hf_elixir               the same with nothing offloaded (set against fsdp2 and deepspeed)
- fsdp2_offload           fully_shard(..., offload_policy=CPUOffloadPolicy()) per block and
                          root; torch AdamW(fused=True)
- fsdp2                   fully_shard per block and root; torch AdamW(fused=True)
- deepspeed_offload       DeepSpeed ZeRO-3, optimizer and parameters offloaded to the CPU;
                          DeepSpeedCPUAdam (adamw_mode), the optimizer DeepSpeed requires there
- deepspeed               DeepSpeed ZeRO-3 without offload; torch AdamW(fused=True) as
                          DeepSpeed's client optimizer

Each system runs in ranks of its own: DeepSpeed's engine keeps its model alive after
gc.collect() (about 1 GB a run at 124M), so systems run one after another in the same
ranks would add up. (hf_elixir had the same problem, through gradient hooks on the
parameters; it is fixed and tested in tests/test_runtime_features.py.) Offloaded systems are given as ratios to fsdp2_offload, the others to
fsdp2. DeepSpeed ZeRO-3 takes the bucket sizes Hugging Face's integration picks for "auto"
(DeepSpeed's own 5e8-element reduce bucket is a 2 GB buffer per rank). DeepSpeed is
driven directly (deepspeed.initialize with a config dict on the gloo process group this
script creates; Accelerate ignores its DeepSpeed plugin on CPU) and its CPU accelerator is
used; DeepSpeedCPUAdam is JIT-compiled on first use (about a minute, once) and gets
OMP_NUM_THREADS=--threads, the cores torch gets per rank. If deepspeed is
not installed its systems are skipped, and the results say so.

On CPU the compute device and the offload target are the same memory, so what offload
costs here is the extra copying and bookkeeping, not PCIe transfers. "peak device bytes"
is hf_elixir's own accounting (memory_report()["peak_total"]): what it holds on the compute
device, which offloading reduces. Results go to benchmarks/results/bench_offload.json and a
PNG beside it.

Host memory: as in bench_step.py, every rank starts as ``hf-elixir launch`` starts CPU
ranks, and by default every system runs with freed host memory kept mapped (the setting
hf_elixir makes on a CPU device), so that all systems share one allocator setting;
``--keep-host-memory hf_elixir`` gives the baselines glibc's defaults instead.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
from pathlib import Path

import torch

from bench_step import (MODELS, RESULTS, add_host_memory_option, blocks_of, launch_each, plain_step, pyplot,
                        setup_elixir)

OFFLOADED = ["hf_elixir_offload", "hf_elixir_offload_half", "fsdp2_offload", "deepspeed_offload"]
ORDER = ["fsdp2_offload", "hf_elixir_offload", "hf_elixir_offload_half", "deepspeed_offload",
         "fsdp2", "hf_elixir", "deepspeed"]
OPTIMIZER = {
    "hf_elixir_offload": "torch.optim.AdamW fused kernel (ElixirOptimizer, on CPU-held shards)",
    "hf_elixir_offload_half": "torch.optim.AdamW fused kernel (ElixirOptimizer)",
    "hf_elixir": "torch.optim.AdamW fused kernel (ElixirOptimizer)",
    "fsdp2_offload": "torch.optim.AdamW(fused=True)",
    "fsdp2": "torch.optim.AdamW(fused=True)",
    "deepspeed_offload": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)",
    "deepspeed": "torch.optim.AdamW(fused=True) (DeepSpeed client optimizer)",
}
# DeepSpeed calls torch.distributed functions torch 2.13 deprecates, warning on every step
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
LR, WEIGHT_DECAY = 1e-4, 0.01  # torch AdamW's default weight decay, given to DeepSpeedCPUAdam too


def setup_fsdp2(model, offload: bool):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # pinning needs an accelerator; on CPU the offloaded shards are plain host memory
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for block in blocks_of(model):
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return plain_step(model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True)), {}


def setup_deepspeed(model, offload: bool, micro_batch: int):
    import deepspeed

    import torch.distributed as dist

    # what a launcher would set; DeepSpeed asserts LOCAL_RANK (one machine: local rank = rank)
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))
    deepspeed.init_distributed(dist_backend="gloo")  # the process group exists: reuses it
    # the sizes Hugging Face's DeepSpeed integration picks for "auto" (from the hidden size);
    # DeepSpeed's own defaults (reduce bucket 5e8 elements, a 2 GB fp32 buffer) exhaust 24 GB at 124M
    h = model.config.hidden_size
    zero: dict = {"stage": 3, "reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                  "stage3_param_persistence_threshold": 10 * h}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()  # clips, updates and zeroes the gradients
        return loss

    return step, {}


def deepspeed_status() -> str | None:
    """None when DeepSpeed can be used, else why not."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"deepspeed not importable: {exc!r} (pip install -e .[bench])"
    return None


def systems_for(args) -> dict:
    micro = args.global_batch // args.world_size
    return {
        "fsdp2_offload": functools.partial(setup_fsdp2, offload=True),
        "hf_elixir_offload": functools.partial(setup_elixir, offload_fraction=1.0),
        "hf_elixir_offload_half": functools.partial(setup_elixir, offload_fraction=0.5),
        "deepspeed_offload": functools.partial(setup_deepspeed, offload=True, micro_batch=micro),
        "fsdp2": functools.partial(setup_fsdp2, offload=False),
        "hf_elixir": setup_elixir,
        "deepspeed": functools.partial(setup_deepspeed, offload=False, micro_batch=micro),
    }


def summarise(results: dict, args) -> dict:
    tokens = args.global_batch * args.seq_len
    summary = {}
    for model_name, by_system in results.items():
        ref_losses = by_system[args.systems[0]]["losses"][:2]
        med = {s: r["median_step_s"] for s, r in by_system.items()}
        rows = {}
        for system, res in by_system.items():
            offloaded = system in OFFLOADED
            base_name = "fsdp2_offload" if offloaded else "fsdp2"
            rows[system] = {
                "median_step_s": res["median_step_s"],
                "tokens_per_s": tokens / res["median_step_s"],
                "offloaded": offloaded,
                "baseline": base_name,
                "ratio_to_baseline": med[system] / med[base_name] if base_name in med else None,
                "ratio_to_fsdp2": med[system] / med["fsdp2"] if "fsdp2" in med else None,
                "ratio_to_fsdp2_offload": med[system] / med["fsdp2_offload"] if "fsdp2_offload" in med else None,
                "optimizer": OPTIMIZER[system],
                "peak_device_bytes": res.get("peak_device_bytes"),
                "first_losses": res["losses"][:2],
                "losses_match": all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(ref_losses, res["losses"][:2])),
            }
            for key in ("n_chunks", "chunk_size", "cache_stats"):
                if key in res:
                    rows[system][key] = res[key]
        summary[model_name] = rows
    return summary


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(summary), figsize=(7 * len(summary), 4.5), squeeze=False)
    for ax, (model_name, rows) in zip(axes[0], summary.items()):
        names = list(rows)
        colors = ["#4a7" if n.startswith("hf_elixir") else "#c66" if n.startswith("fsdp2") else "#68c"
                  for n in names]
        hatches = ["//" if rows[n]["offloaded"] else "" for n in names]
        bars = ax.bar(range(len(names)), [rows[n]["median_step_s"] for n in names], color=colors)
        for bar, h in zip(bars, hatches):
            bar.set_hatch(h)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{model_name}: median step (s)\nhatched: offloaded, ratio to fsdp2_offload; "
                     "others to fsdp2", fontsize=10)
        for i, n in enumerate(names):
            r = rows[n]["ratio_to_baseline"]
            ax.text(i, rows[n]["median_step_s"], "" if r is None else f"{r:.2f}x", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2-30m", "gpt2-124m"], choices=list(MODELS))
    p.add_argument("--systems", nargs="+", default=ORDER, choices=ORDER)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    add_host_memory_option(p)
    p.add_argument("--output", type=Path, default=RESULTS / "bench_offload.json")
    args = p.parse_args()
    if args.global_batch % args.world_size:
        sys.exit("--global-batch must be divisible by --world-size")
    skipped = {}
    why = deepspeed_status() if any(s.startswith("deepspeed") for s in args.systems) else None
    if why:
        skipped = {s: why for s in args.systems if s.startswith("deepspeed")}
        args.systems = [s for s in args.systems if s not in skipped]
        print(f"skipping {', '.join(skipped)}: {why}")
    # DeepSpeed's CPU Adam runs OpenMP threads: give it the ranks' share of the cores, as torch gets
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, args.threads)))
    # each system in ranks of its own (see the docstring): no leaks or heap carried over
    results = launch_each(args, systems_for(args))
    summary = summarise(results, args)
    record = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "skipped": skipped,
        "summary": summary,
        "raw": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1))
    plot(summary, args.output.with_suffix(".png"))
    print(f"\n{'model':10s} {'system':23s} {'step s':>7s} {'tok/s':>6s} {'ratio':>5s} {'to':14s} "
          f"{'peak dev MB':>11s} losses  optimizer")
    for model_name, rows in summary.items():
        for system, row in rows.items():
            r = row["ratio_to_baseline"]
            peak = row["peak_device_bytes"]
            print(f"{model_name:10s} {system:23s} {row['median_step_s']:7.3f} {row['tokens_per_s']:6.0f} "
                  f"{'' if r is None else f'{r:5.2f}'} {row['baseline']:14s} "
                  f"{'' if peak is None else f'{peak / 2**20:11.1f}'}{'' if peak is not None else ' ' * 11} "
                  f"{'equal ' if row['losses_match'] else 'DIFFER'}  {row['optimizer']}")
    for system, reason in skipped.items():
        print(f"skipped {system}: {reason}")
    print(f"wrote {args.output}")


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


if __name__ == "__main__":
    main()
