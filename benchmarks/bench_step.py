"""Training-step time of hf_elixir against plain DDP and FSDP2, in one run.

    python benchmarks/bench_step.py                       # three models, world size 2
    python benchmarks/bench_step.py --models gpt2-30m --steps 3
    python benchmarks/bench_step.py --compile             # compiled against eager (issue 64)
    python benchmarks/bench_step.py --compile --quick     # a check that it runs, not a figure

Every system trains the same model (same seed, same data; bench_planner's GPT-2 30M, GPT-2
124M and Llama-style 60M) on CPU over gloo: global batch 4,
sequence 128, fp32, AdamW (the fused kernel for all three, so the optimizer
implementation is not what is compared), clipping at 1.0. After the warm-up steps the
median of the timed steps is reported with each system's ratio to DDP, and the losses of
the first steps are checked equal across systems. Each system runs in fresh ranks of its own
(``launch_each``), so that none inherits another's heap. Results go to
benchmarks/results/bench_step.json and a PNG beside it.

Bytes on the wire: after the timed steps every system runs one more step under a
``WireCounter`` (hf_elixir/runtime/comm_count.py), which sees each c10d collective and
counts the bytes a rank receives by the ring convention (all-gather and reduce-scatter
B(W-1)/W, all-reduce 2B(W-1)/W, broadcast B). The same counter for every system; it is not
active in the timed steps (it costs Python time per op). Two hf_elixir rows:

- ``hf_elixir``: what runs on gloo by default: a gather is W broadcasts (counted under
  broadcast; the bytes of an all-gather) and a gradient reduction an all-reduce (faster
  than gloo's reduce-scatter, twice the bytes; see runtime/comm.py).
- ``hf_elixir_tensor``: HF_ELIXIR_COLLECTIVES=tensor, the collectives NCCL runs on a GPU
  (all-gather, reduce-scatter): the bytes hf_elixir moves with NCCL.

Two FSDP2 rows. ``fsdp2`` wraps each block and the root, as FSDP2 is usually applied; the
root's own parameters stay gathered from forward into backward, so FSDP2 moves them in one
all-gather, not two. ``fsdp2_reshard_all`` also wraps the input embedding and an untied
head, so that every parameter but the final norm is gathered twice a step (GPT-2's tied
head cannot be split from its embedding: there it wraps as ``fsdp2`` does). Each FSDP2
row records ``root_param_share`` s and the best ratio hf_elixir can reach against it,
2 / (3 - s): one all-gather and one reduce-scatter against two all-gathers and one.

The hf_elixir rows also carry the runtime's own counter and the planner's prediction.

Host memory: every rank starts as ``hf-elixir launch`` starts CPU ranks, with glibc's
per-thread cache off (without it the heap fragments under gloo;
hf_elixir/runtime/host_memory.py), and by default every system runs with freed host memory
kept mapped, the setting hf_elixir itself makes on a CPU device, so that all systems share
one allocator setting (``--keep-host-memory all``). ``--keep-host-memory hf_elixir`` leaves
DDP and FSDP2 with glibc's other defaults, as a user of them gets them (each system runs in
ranks of its own, so none inherits hf_elixir's setting), to show what the setting is worth.

Compiled (``--compile``, issue 64): ``ddp_compiled``, ``fsdp2_compiled`` and
``hf_elixir_compiled`` beside the eager ``ddp``, ``fsdp2`` and ``hf_elixir``. All three
compile the same region, each decoder layer's ``forward`` (inductor), its ``__call__`` and
hooks eager: what hf_elixir's runtime compiles (runtime/compiled.py), what Accelerate's
regional compilation compiles, and FSDP2 per block (``fully_shard`` on each layer, each
layer compiled). The warm-up steps carry the compile. The summary's ``compile`` block per
model: hf_elixir compiled over DDP compiled and over FSDP2 compiled (step-time ratios), and
what compile gains each (eager step over compiled step), with dynamo's counters per system
to show the compile ran. ``--quick``: gpt2-30m at 2 x 32 tokens, 2 warm-up and 2 timed
steps, every system (eager FSDP2 left out) in the same two ranks (a check that it runs,
not a figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# the models bench_planner plans (same configs, same seed): GPT-2 ties its head to the
# input embedding, the Llama-style model does not
from bench_planner import MODELS, build

RESULTS = Path(__file__).resolve().parent / "results"


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The transformer's list of layers (the largest ModuleList)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def batch_for(rank: int, world: int, step: int, global_batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (global_batch, seq), generator=g)
    per = global_batch // world
    return ids[rank * per : (rank + 1) * per]


# ---------------------------------------------------------------------- systems
def plain_step(model, opt):
    """One step of plain PyTorch training (the DDP and FSDP2 baselines)."""

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def elixir_step(em, opt):
    """One step of training through hf_elixir (its module and optimizer)."""

    def step(ids):
        loss = em(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def setup_ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    return plain_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)), {}


def setup_fsdp2(model):
    """FSDP2 as it is usually applied: each block, then the root. The root's own parameters
    (GPT-2's tied embedding; Llama's embedding, head and final norm) stay gathered from
    forward into backward: FSDP2 does not reshard the root after forward."""
    return _fsdp2(model, split_embeddings=False)


def setup_fsdp2_reshard_all(model):
    """FSDP2 with the input embedding and an untied head sharded as modules of their own, so
    that FSDP2 reshards them after forward and gathers them again in backward, as it does the
    blocks. A tied head cannot be split from its embedding (both must stay in one FSDP
    module), so for GPT-2 this is the same wrapping as ``fsdp2``."""
    return _fsdp2(model, split_embeddings=True)


def _fsdp2(model, split_embeddings: bool):
    from torch.distributed.fsdp import fully_shard

    emb_in, emb_out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = emb_out is not None and emb_out.weight is emb_in.weight
    own = [*blocks_of(model)]
    if split_embeddings and not tied:
        own = [emb_in, *own] + ([emb_out] if emb_out is not None else [])
    for module in own:
        fully_shard(module)
    fully_shard(model)
    return plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)), _root_share(model)


def _root_share(model) -> Callable[[], dict]:
    """The share of the parameters FSDP2 keeps gathered between forward and backward (those
    of the root's own group). Per step FSDP2 then moves 3 - s all-gather/reduce-scatter
    units and hf_elixir with every chunk cached 2, so the best ratio is 2 / (3 - s)."""
    from torch.distributed.fsdp import FSDPModule

    inner = {id(p) for m in model.modules() if m is not model and isinstance(m, FSDPModule) for p in m.parameters()}
    params = list(model.parameters())
    share = sum(p.numel() for p in params if id(p) not in inner) / sum(p.numel() for p in params)
    return lambda: {"root_param_share": share, "best_bytes_ratio": 2 / (3 - share)}


def compile_blocks(model) -> None:
    """Each decoder layer's ``forward`` compiled (inductor), its ``__call__`` and hooks
    (DDP's none, FSDP2's gathers) eager: the region hf_elixir's runtime compiles, so the
    compiled systems compare the same compiled code."""
    for block in blocks_of(model):
        block.forward = torch.compile(block.forward)


def setup_ddp_compiled(model):
    compile_blocks(model)
    return setup_ddp(model)


def setup_fsdp2_compiled(model):
    """FSDP2 per block, then each block compiled (its hooks outside the compiled forward)."""
    step, info = setup_fsdp2(model)
    compile_blocks(model)
    return step, info


def setup_elixir_compiled(model):
    """hf_elixir with ``ElixirModule(compile=True)``: each block's forward compiled."""
    return setup_elixir(model, compile=True)


def setup_elixir(model, tensor_collectives: bool = False, recover_oom: bool = True, compile: bool = False,
                 **plan_kwargs):
    """hf_elixir with ElixirPlan.simple; plan_kwargs (e.g. offload_fraction) go to the plan;
    ``tensor_collectives``: NCCL's collectives instead of gloo's strategy; ``recover_oom``: the
    runtime's out-of-memory recovery (on by default, as for users); ``compile``: the
    runtime's regional compile."""
    import hf_elixir as hfe
    from hf_elixir.planner import traffic

    world = dist.get_world_size()
    largest = max(p.numel() for p in model.parameters())
    # every chunk holds at most PACK_SIZE elements (the embedding gets one of its own): small
    # chunks let gathers and reduce-scatters overlap the layers' compute
    plan = hfe.ElixirPlan.simple(model, world, chunk_size=largest, rcache_blocks=None, pack_size=PACK_SIZE,
                                 **plan_kwargs)
    numels = {n: p.numel() for n, p in model.named_parameters()}
    gathers = traffic.traced_gathers(plan, model, (4, 16))
    predicted = traffic.plan_traffic(plan, numels, gathers, "cpu", host=not tensor_collectives)
    if tensor_collectives:
        os.environ[traffic.COLLECTIVES_ENV] = "tensor"
    try:
        em = hfe.ElixirModule(model, plan, recover_oom=recover_oom, compile=compile or None)
    finally:
        os.environ.pop(traffic.COLLECTIVES_ENV, None)
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-4))
    step = elixir_step(em, opt)

    def info():
        rep = em.memory_report()
        return {"n_chunks": plan.n_chunks, "chunk_size": plan.chunk_size, "rcache_blocks": plan.rcache_blocks,
                "peak_device_bytes": rep["peak_total"], "cache_stats": rep["cache_stats"],
                "predicted_bytes_per_step": predicted.bytes}

    def comm_window(reset: bool) -> dict:
        """The runtime's own counter (reset at the window's start)."""
        report = em.comm_report(reset=reset)
        return {k: v // max(1, report["steps"]) for k, v in report["bytes"].items()}

    info.comm_window = comm_window
    return step, info


def setup_elixir_tensor(model):
    """hf_elixir with the tensor collectives NCCL uses (all-gather, reduce-scatter) on gloo."""
    return setup_elixir(model, tensor_collectives=True)


PACK_SIZE = 2_000_000

SYSTEMS = {"ddp": setup_ddp, "fsdp2": setup_fsdp2, "fsdp2_reshard_all": setup_fsdp2_reshard_all,
           "hf_elixir": setup_elixir, "hf_elixir_tensor": setup_elixir_tensor,
           "ddp_compiled": setup_ddp_compiled, "fsdp2_compiled": setup_fsdp2_compiled,
           "hf_elixir_compiled": setup_elixir_compiled}
#: what runs by default, and with --compile
EAGER_SYSTEMS = ["ddp", "fsdp2", "fsdp2_reshard_all", "hf_elixir", "hf_elixir_tensor"]
COMPILE_SYSTEMS = ["ddp", "ddp_compiled", "fsdp2", "fsdp2_compiled", "hf_elixir", "hf_elixir_compiled"]


def dynamo_counts() -> dict:
    """Dynamo's counters in this rank since they were last cleared: frames compiled,
    distinct graphs, recompiles (all zero for an eager system)."""
    from torch._dynamo.utils import counters

    return {"frames_ok": counters["frames"]["ok"], "unique_graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values())}


def timed_step(step, ids) -> tuple[float, float]:
    """One step between barriers, so that every rank's time covers the slowest rank's step:
    (its seconds, its loss averaged over ranks)."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = step(ids)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total)
    return elapsed, total.item() / dist.get_world_size()


def timed_steps(step, rank: int, world: int, args, vocab: int) -> tuple[list[float], list[float]]:
    """Run warm-up and timed steps: (the timed steps' seconds, every step's loss averaged
    over ranks)."""
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        elapsed, loss = timed_step(step, batch_for(rank, world, i, args.global_batch, args.seq_len, vocab))
        losses.append(loss)
        if i >= args.warmup:
            times.append(elapsed)
    return times, losses


def run_system(name: str, model_name: str, args, systems: dict | None = None) -> dict:
    """Train one system (looked up in systems, default SYSTEMS) and time its steps."""
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()  # systems sharing ranks (--quick) each compile their own code
    counters.clear()
    model = build(model_name)
    vocab = model.config.vocab_size
    step, info = (SYSTEMS if systems is None else systems)[name](model)
    times, losses = timed_steps(step, rank, world, args, vocab)
    out = {"median_step_s": statistics.median(times), "step_times_s": times, "losses": losses,
           "dynamo": dynamo_counts()}
    out["bytes_per_step"] = counted_step(step, info, rank, world, args.warmup + args.steps, args, vocab)
    if callable(info):
        out.update(info())
        if hasattr(info, "comm_window"):
            out["runtime_bytes_per_step"] = info.comm_window(reset=False)
    del model, step
    return out


def counted_step(step, info, rank: int, world: int, index: int, args, vocab: int) -> dict:
    """One more step under a WireCounter: the bytes this rank received, by kind."""
    from hf_elixir.runtime.comm_count import WireCounter

    window = getattr(info, "comm_window", None)
    if window is not None:
        window(reset=True)
    ids = batch_for(rank, world, index, args.global_batch, args.seq_len, vocab)
    counter = WireCounter()
    dist.barrier()
    with counter:
        step(ids)
    dist.barrier()
    # collectives the counter cannot classify (none for these three systems) are named, not hidden
    return dict(counter.counter.bytes, total=counter.counter.total(), unclassified=dict(counter.unknown))


def add_host_memory_option(parser: argparse.ArgumentParser) -> None:
    """The allocator option every benchmark shares: which systems run with freed host memory
    kept mapped. All of them by default, so that a comparison never hinges on an allocator
    setting one system got and its baselines did not."""
    parser.add_argument("--keep-host-memory", choices=("all", "hf_elixir"), default="all",
                        help="which systems run with freed host memory kept mapped: all (default, "
                             "the same allocator for every system) or hf_elixir (the baselines "
                             "keep glibc's defaults, as their users get them)")


def apply_host_memory_setting(args) -> None:
    """In a fresh rank, before any system runs: make glibc keep freed memory mapped when every
    system is to run that way (hf_elixir makes the same setting itself on a CPU device)."""
    if getattr(args, "keep_host_memory", "all") == "all":
        from hf_elixir.runtime.host_memory import keep_freed_host_memory

        keep_freed_host_memory()


def worker(rank: int, world: int, port: int, args, queue, systems: dict | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads))
    apply_host_memory_setting(args)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    for model_name in args.models:
        for system in args.systems:
            res = run_system(system, model_name, args, systems)
            if rank == 0:
                print(f"{model_name:10s} {system:16s} median step {res['median_step_s']:.3f} s", flush=True)
            results.setdefault(model_name, {})[system] = res
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def summarise(results: dict, args) -> dict:
    tokens = args.global_batch * args.seq_len
    summary = {}
    for model_name, by_system in results.items():
        base = by_system["ddp"]["median_step_s"] if "ddp" in by_system else None
        ref_losses = by_system[args.systems[0]]["losses"][:2]
        rows = {}
        for system, res in by_system.items():
            rows[system] = {
                "median_step_s": res["median_step_s"],
                "tokens_per_s": tokens / res["median_step_s"],
                "ratio_to_ddp": res["median_step_s"] / base if base else None,
                "first_losses": res["losses"][:2],
                "losses_match": all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(ref_losses, res["losses"][:2])),
            }
            for key in ("n_chunks", "chunk_size", "rcache_blocks", "peak_device_bytes", "cache_stats",
                        "bytes_per_step", "runtime_bytes_per_step", "predicted_bytes_per_step",
                        "root_param_share", "best_bytes_ratio", "dynamo"):
                if key in res:
                    rows[system][key] = res[key]
        for base_name in ("fsdp2", "fsdp2_reshard_all"):
            if base_name not in rows:
                continue
            base_row = rows[base_name]
            suffix = "" if base_name == "fsdp2" else "_reshard_all"
            for name in ("hf_elixir", "hf_elixir_tensor"):
                if name in rows:
                    rows[name][f"ratio_to_fsdp2{suffix}"] = rows[name]["median_step_s"] / base_row["median_step_s"]
                    rows[name][f"bytes_ratio_to_fsdp2{suffix}"] = (rows[name]["bytes_per_step"]["total"]
                                                                  / base_row["bytes_per_step"]["total"])
        if "hf_elixir_compiled" in rows:
            rows["compile"] = compile_summary(rows)
        summary[model_name] = rows
    return summary


def compile_summary(rows: dict) -> dict:
    """Issue 64's figures from one model's rows: hf_elixir compiled over DDP compiled and
    over FSDP2 compiled (step-time ratios; the targets are at most 1.0 and 0.70), and what
    compile gains DDP and hf_elixir (eager step / compiled step; hf_elixir's should be at
    least DDP's). A figure whose rows did not run is None."""
    def step(name: str) -> float | None:
        return rows[name]["median_step_s"] if name in rows else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b is not None else None

    ours = step("hf_elixir_compiled")
    gain_elixir, gain_ddp = ratio(step("hf_elixir"), ours), ratio(step("ddp"), step("ddp_compiled"))
    return {"hf_elixir_compiled_over_ddp_compiled": ratio(ours, step("ddp_compiled")),
            "hf_elixir_compiled_over_fsdp2_compiled": ratio(ours, step("fsdp2_compiled")),
            "compile_gain_hf_elixir": gain_elixir, "compile_gain_ddp": gain_ddp,
            "compile_gain_fsdp2": ratio(step("fsdp2"), step("fsdp2_compiled")),
            "gain_at_least_ddp": None if gain_elixir is None or gain_ddp is None else gain_elixir >= gain_ddp}


def pyplot():
    """matplotlib's pyplot on a file-only backend, or None (with a note) if not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return None
    return plt


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(summary), figsize=(5 * len(summary), 4), squeeze=False)
    for ax, (model_name, rows) in zip(axes[0], summary.items()):
        names = [n for n in rows if n != "compile"]
        ax.bar(names, [rows[n]["median_step_s"] for n in names],
               color=(["#888", "#c66", "#e99", "#4a7", "#7a4", "#46c"] * 2)[: len(names)])
        ax.set_title(f"{model_name}: median step (s)")
        for i, n in enumerate(names):
            r = rows[n]["ratio_to_ddp"]
            ax.text(i, rows[n]["median_step_s"], f"{r:.2f}x DDP" if r else "", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def launch_each(args, systems: dict | None = None) -> dict:
    """Every (model, system) pair in ranks of its own, one pair after another: no system
    inherits another's heap, allocator state or leaked memory (systems run one after another
    in the same ranks slowed whichever came later). Returns {model: {system: {...}}}."""
    results: dict = {}
    for model_name in args.models:
        for system in args.systems:
            one = argparse.Namespace(**{**vars(args), "models": [model_name], "systems": [system]})
            results.setdefault(model_name, {}).update(launch(one, systems)[model_name])
    return results


def launch(args, systems: dict | None = None, target: Callable = None) -> dict:
    """Spawn args.world_size ranks over gloo; each runs args.systems on args.models.

    Returns rank 0's results: {model: {system: {...}}}. systems (default SYSTEMS) maps a
    system's name to its setup function (picklable: spawned ranks receive it). ``target``
    (default ``worker``) is what each rank runs, called as ``worker`` is; it puts rank 0's
    results on the queue.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from hf_elixir.measure.calibrate import run_then_freeze
    from hf_elixir.runtime.host_memory import spawning_cpu_ranks

    procs = [ctx.Process(target=run_then_freeze, args=(target or worker, r, args.world_size, port, args, queue, systems))
             for r in range(args.world_size)]
    with spawning_cpu_ranks():  # every system's ranks start as hf-elixir launch starts them
        for proc in procs:
            proc.start()
    while True:  # a rank that dies would otherwise leave this waiting forever
        try:
            results = queue.get(timeout=5)
            break
        except Empty:
            failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if failed:
                for proc in procs:
                    proc.kill()
                sys.exit(f"a rank failed (exit codes {failed}); see its traceback above")
    for proc in procs:
        proc.join()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--systems", nargs="+", default=None, choices=list(SYSTEMS),
                   help=f"default: {' '.join(EAGER_SYSTEMS)}; with --compile: {' '.join(COMPILE_SYSTEMS)}")
    p.add_argument("--compile", action="store_true",
                   help="compiled systems (each decoder layer compiled) beside their eager runs")
    p.add_argument("--quick", action="store_true",
                   help="gpt2-30m, 2 x 32 tokens, 2 warm-up and 2 timed steps, all systems in one pair of "
                        "ranks: a check that it runs, not a figure")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    add_host_memory_option(p)
    p.add_argument("--output", type=Path, default=RESULTS / "bench_step.json")
    args = p.parse_args()
    if args.systems is None:  # --quick leaves eager FSDP2 out: the compile figures do not need it
        args.systems = [s for s in (COMPILE_SYSTEMS if args.compile else EAGER_SYSTEMS)
                        if not (args.quick and args.compile and s == "fsdp2")]
    if args.quick:
        args.models, args.global_batch, args.seq_len, args.warmup, args.steps = ["gpt2-30m"], 2, 32, 2, 2
    if args.global_batch % args.world_size:
        sys.exit("--global-batch must be divisible by --world-size")
    results = launch(args) if args.quick else launch_each(args)
    summary = summarise(results, args)
    record = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "summary": summary,
        "raw": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1))
    plot(summary, args.output.with_suffix(".png"))
    print(f"\n{'model':10s} {'system':16s} {'step s':>8s} {'tok/s':>8s} {'xDDP':>6s} {'xFSDP2':>7s} losses")
    for model_name, rows in summary.items():
        for system, row in rows.items():
            if system == "compile":
                continue
            xf = row.get("ratio_to_fsdp2")
            print(f"{model_name:10s} {system:16s} {row['median_step_s']:8.3f} {row['tokens_per_s']:8.0f} "
                  f"{row['ratio_to_ddp'] or 0:6.2f} {'' if xf is None else f'{xf:7.2f}'} "
                  f"{'equal' if row['losses_match'] else 'DIFFER'}")
    print_bytes(summary)
    print_compile(summary)
    print(f"wrote {args.output}")


def print_compile(summary: dict) -> None:
    """The compile block of each model, in words (``compile_summary``)."""
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for model_name, rows in summary.items():
        c = rows.get("compile")
        if c is None:
            continue
        print(f"\ncompiled {model_name}: hf_elixir {f(c['hf_elixir_compiled_over_ddp_compiled'])}x DDP's step "
              f"(target <= 1.0), {f(c['hf_elixir_compiled_over_fsdp2_compiled'])}x FSDP2's (target <= 0.70); "
              f"compile gains hf_elixir {f(c['compile_gain_hf_elixir'])}x, DDP {f(c['compile_gain_ddp'])}x, "
              f"FSDP2 {f(c['compile_gain_fsdp2'])}x")


def print_bytes(summary: dict) -> None:
    """Bytes per step each rank receives, by kind (the WireCounter's convention)."""
    kinds = ("all_gather", "broadcast", "reduce_scatter", "all_reduce")
    print(f"\nbytes per step per rank (MB): {'model':10s} {'system':17s} "
          + " ".join(f"{k:>14s}" for k in kinds) + f" {'total':>9s} {'xFSDP2':>7s} {'xFSDP2_all':>10s} {'best':>5s}")
    for model_name, rows in summary.items():
        for system, row in rows.items():
            if system == "compile":
                continue
            b = row["bytes_per_step"]
            ratios = [row.get("bytes_ratio_to_fsdp2"), row.get("bytes_ratio_to_fsdp2_reshard_all")]
            best = row.get("best_bytes_ratio")
            print(f"{'':29s}{model_name:10s} {system:17s} " + " ".join(f"{b[k] / 1e6:14.2f}" for k in kinds)
                  + f" {b['total'] / 1e6:9.2f} " + " ".join("" if r is None else f"{r:7.3f}" for r in ratios)
                  + ("" if best is None else f" (hf_elixir's best against this: {best:.3f})"))
    print("hf_elixir: gloo's strategy (gathers as broadcasts, gradients all-reduced); "
          "hf_elixir_tensor: the all-gather/reduce-scatter NCCL runs")


if __name__ == "__main__":
    main()
