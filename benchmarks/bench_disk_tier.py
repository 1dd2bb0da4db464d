"""The disk tier against the host tier: what keeping optimizer state on disk costs a step.

    python benchmarks/bench_disk_tier.py                      # a temp dir on this machine's disk
    python benchmarks/bench_disk_tier.py --path /mnt/nvme     # the directory to measure and use
    python benchmarks/bench_disk_tier.py --quick --out /tmp/q.json   # a tiny model, seconds
    python benchmarks/bench_disk_tier.py --device cuda        # compute on the GPU (the GPU suite's section)

One run does three things on the same directory:

1. measures the disk under it with ``measure/disk.py``'s ``measure_disk`` (sequential write
   through ``fsync`` and cold read, ``O_DIRECT`` where allowed) at blocks the size of one
   plane of a disk chunk, the size the tier reads in; once before the systems run and once
   after, since a shared machine's disk drifts; the mean of the two is the reference;
2. trains the same model, data and AdamW under three plans that differ only in where the
   trainable chunks' optimizer side lives:

   - ``disk_half``: half of the trainable chunks (every other one, by size) on ``"disk"``
     (fp32 master, Adam's moments and the fp32 gradient in a file under the directory), the
     rest on ``"cpu"``;
   - ``host``: every trainable chunk on ``"cpu"`` (the host tier, updated on the host
     update thread): the baseline, and the tier the disk tier must equal bit for bit;
   - ``device``: every chunk's state with its parameters (on a CPU device the update runs
     inside ``step()``): what offloading costs at all, for scale;

   each in fresh processes of its own (``bench_step.launch``: the same allocator environment
   as every CPU benchmark), ``--warmup`` steps then ``--steps`` timed ones, medians;
   ``--device`` picks the compute device, passed to ``ElixirModule`` as is (default: its own
   default, the CPU on a machine without CUDA; ``cuda``: rank r on ``cuda:r``, steps timed
   between ``torch.cuda.synchronize()`` calls);
3. reads the disk tier's own I/O counters (``DiskTier.io_counters``: bytes read and written,
   seconds per direction, and the wall time while any transfer was in flight) over the timed
   steps, and relates one step's traffic to the measured bandwidth.

The figures that matter are ratios (``docs/benchmarks.md``, "bench_disk_tier"):
``io_efficiency`` (the time the measured bandwidth needs for one step's reads and writes over
the time the tier's transfers were in flight: 1.0 is the disk's sequential speed; the
acceptance asks >= 0.7), ``step_ratio_disk_to_host`` and ``weights_match`` / ``losses_match``
(the disk tier's results equal the host tier's, bit for bit). Results go to
``benchmarks/results/bench_disk_tier.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_step import add_host_memory_option, apply_host_memory_setting, launch  # noqa: E402

import hf_elixir as hfe  # noqa: E402
from hf_elixir.measure.disk import measure_disk  # noqa: E402

RESULTS = HERE / "results" / "bench_disk_tier.json"
SYSTEMS = ("disk_half", "host", "device")
VOCAB = 64
#: the full run: 72 layers of 1024 x 1024 (75M parameters), 4 layers a chunk: 18 chunks, 9
#: of them on disk with 8 bytes of Adam state per parameter there, about 300 MB
FULL = dict(width=1024, layers=72, layers_per_chunk=4, batch=2, seq_len=32, warmup=2, steps=6,
            disk_total=256 * 2**20)
#: ``--quick``: 16 layers of 128 x 128, a layer a chunk (8 disk chunks, more than the ring)
QUICK = dict(width=128, layers=16, layers_per_chunk=1, batch=1, seq_len=16, warmup=2, steps=3,
             disk_total=16 * 2**20)


class DeepLM(nn.Module):
    """A causal LM of equal residual layers, without transformers (ranks start in a second or
    two): with ``chunk_size`` a multiple of ``width**2`` every chunk holds whole layers, so
    chunks are equal and "half of the chunks" is half of the state."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def build_plan(model: nn.Module, system: str, world_size: int, chunk_size: int) -> hfe.ElixirPlan:
    """The one plan every system shares, less placement (the module docstring's systems)."""
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=chunk_size,
                                 offload_fraction=0.0 if system == "device" else 1.0)
    if system == "disk_half":
        for chunk in sorted((c for c in plan.chunks if not c.frozen), key=lambda c: c.numel)[::2]:
            chunk.optim_placement = "disk"
    return plan


def batches(rank: int, count: int, batch: int, seq_len: int) -> list[torch.Tensor]:
    """The same token batches for every system (per rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, VOCAB, (batch, seq_len), generator=g) for _ in range(count)]


def digest(state: dict[str, torch.Tensor]) -> str:
    """A hash of the trained weights: equal digests are equal weights, bit for bit."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_system(rank: int, world: int, args) -> dict:
    """Train one system in this rank; its step times, losses, weights' digest and, for the
    disk tier, the I/O counters over the timed steps."""
    system = args.systems[0]
    torch.manual_seed(0)
    model = DeepLM(args.width, args.layers)
    plan = build_plan(model, system, world, args.layers_per_chunk * args.width ** 2)
    device = None if args.device is None else (
        torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu"))
    emodel = hfe.ElixirModule(model, plan, device=device, nvme_path=args.path if system == "disk_half" else None)
    sync = torch.cuda.synchronize if emodel.device.type == "cuda" else (lambda: None)
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    data = batches(rank, args.warmup + args.steps, args.batch, args.seq_len)
    losses, times, before = [], [], None
    for i, ids in enumerate(data):
        if i == args.warmup:  # the timed window holds exactly the timed steps' I/O
            emodel.host_updates.wait_all()
            if emodel.disk is not None:
                emodel.disk.flush()
                before = emodel.disk.io_counters()
            emodel.time_report(reset=True)
            window = time.perf_counter()
        sync()
        start = time.perf_counter()
        loss = emodel(input_ids=ids, labels=ids)["loss"]
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    emodel.host_updates.wait_all()
    out: dict = {"step_s": times[args.warmup:], "losses": losses, "device": str(emodel.device),
                 "window_s": time.perf_counter() - window, "n_chunks": len(plan.chunks),
                 "disk_chunks": sum(c.optim_placement == "disk" for c in plan.chunks)}
    if emodel.disk is not None:
        emodel.disk.flush()
        after = emodel.disk.io_counters()
        out.update(io={k: after[k] - before[k] for k in after}, disk_state_bytes=emodel.disk.state_bytes,
                   ring_bytes=emodel.disk.ring_bytes, direct_io=emodel.disk.direct,
                   plane_bytes=max(c.plane_bytes for c in emodel.disk.chunks.values()))
    report = emodel.time_report()["measured"]
    out["breakdown_s"] = {k: report[k] for k in ("step", "forward_backward", "cpu_optimizer", "device_optimizer",
                                                 "background", "exposed_cpu", "overlap") if k in report}
    out["weights_sha256"] = digest(emodel.state_dict())
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if emodel.device.type == "cuda":
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated(emodel.device)
    emodel.close()
    return out


def worker(rank: int, world: int, port: int, args, queue, systems=None) -> None:
    """One rank of one system (``bench_step.launch``'s target): rank 0's results go on the queue."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads))
    apply_host_memory_setting(args)
    # one rank needs no collectives (gloo then, CPU or CUDA); CUDA ranks together talk over NCCL
    backend = "nccl" if args.device == "cuda" and world > 1 else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    res = run_system(rank, world, args)
    if rank == 0:
        queue.put({args.systems[0]: res})
    dist.barrier()
    dist.destroy_process_group()


def disk_row(figs) -> dict:
    return {**asdict(figs), "read_MBps": figs.read_bytes_per_s / 1e6, "write_MBps": figs.write_bytes_per_s / 1e6}


def io_summary(res: dict, disk: dict, steps: int, step_s: float, host_step_s: float | None) -> dict:
    """One step's disk traffic against the measured bandwidth (the module docstring)."""
    io = res["io"]
    read, written = io["read_bytes"] / steps, io["written_bytes"] / steps
    rbw, wbw = disk["read_bytes_per_s"], disk["write_bytes_per_s"]
    busy = io["busy_seconds"] / steps
    at_measured = read / rbw + written / wbw  # seconds the measured disk needs for one step's traffic
    exposed = None if host_step_s is None else step_s - host_step_s
    return {
        "read_bytes_per_step": read, "written_bytes_per_step": written,
        "io_busy_s_per_step": busy,
        "achieved_bytes_per_s": (read + written) / busy if busy else None,
        "measured_equivalent_bytes_per_s": (read + written) / at_measured if at_measured else None,
        "io_efficiency": at_measured / busy if busy else None,
        "read_efficiency": (io["read_bytes"] / io["read_seconds"]) / rbw if io["read_seconds"] else None,
        "write_efficiency": (io["written_bytes"] / io["write_seconds"]) / wbw if io["write_seconds"] else None,
        "bytes_per_step_wall_s": (read + written) / step_s,
        "wall_efficiency": at_measured / step_s,
        "exposed_s_per_step": exposed,
        "bytes_per_exposed_s": (read + written) / exposed if exposed and exposed > 0 else None,
    }


def summarise(results: dict, disk: dict, args) -> dict:
    rows = {}
    host = results.get("host")
    for system, res in results.items():
        row = {"median_step_s": statistics.median(res["step_s"]), "step_s": res["step_s"],
               "final_loss": res["losses"][-1], "losses": res["losses"], "weights_sha256": res["weights_sha256"],
               "peak_rss_bytes": res["peak_rss_bytes"], "n_chunks": res["n_chunks"],
               "disk_chunks": res["disk_chunks"], "breakdown_s": res["breakdown_s"], "device": res["device"]}
        for key in ("disk_state_bytes", "ring_bytes", "direct_io", "plane_bytes", "io", "max_memory_allocated"):
            if key in res:
                row[key] = res[key]
        rows[system] = row
    if host is not None:
        for row in rows.values():
            row["step_ratio_to_host"] = row["median_step_s"] / rows["host"]["median_step_s"]
    if "disk_half" in rows:
        row = rows["disk_half"]
        row["traffic"] = io_summary(results["disk_half"], disk, args.steps, row["median_step_s"],
                                    rows["host"]["median_step_s"] if host else None)
        if host is not None:
            row["weights_match_host"] = row["weights_sha256"] == rows["host"]["weights_sha256"]
            row["losses_match_host"] = row["losses"] == rows["host"]["losses"]
    return rows


def wait_for_quiet(limit: float, patience: float) -> list[float]:
    """Wait (every 30 s, ``patience`` seconds at most) until the 1-minute load is under
    ``limit``: the machine is shared, and a neighbour's burst would be charged to a system."""
    deadline = time.monotonic() + patience
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        print(f"load {os.getloadavg()[0]:.2f} >= {limit}: waiting", flush=True)
        time.sleep(30)
    return list(os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", help="the directory to measure and keep the disk tier in (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="a tiny model, a few steps: seconds (the test's mode)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="the compute device (default: ElixirModule's own, the CPU without CUDA)")
    p.add_argument("--width", type=int, help="the layers' width (default: the full or --quick size)")
    p.add_argument("--layers", type=int, help="how many layers")
    p.add_argument("--layers-per-chunk", type=int, help="layers a chunk holds")
    p.add_argument("--disk-total", type=int, help="bytes measure_disk writes and reads, each time")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--threads", type=int, help="torch threads per rank (default: the cores less one, shared by "
                                             "the ranks: a core is left to the host update and I/O threads)")
    p.add_argument("--steps", type=int, help="timed steps per system")
    p.add_argument("--warmup", type=int, help="untimed steps first")
    p.add_argument("--out", type=Path, help=f"results JSON (default {RESULTS.relative_to(HERE.parent)}; "
                                            "--quick: a temp file)")
    p.add_argument("--wait-load", type=float, default=None, metavar="LOAD",
                   help="first wait until the 1-minute load average is under LOAD (every 30 s, --wait-max s)")
    p.add_argument("--wait-max", type=float, default=1200.0)
    add_host_memory_option(p)
    args = p.parse_args()
    size = QUICK if args.quick else FULL
    if args.threads is None:  # two OpenMP teams on every core stall each other on a busy machine
        args.threads = max(1, ((os.cpu_count() or 1) - 1) // args.world_size)
    for key, value in size.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    out_path = args.out or (Path(tempfile.mkdtemp()) / "bench_disk_tier.json" if args.quick else RESULTS)
    scratch = None
    if args.path is None:
        scratch = args.path = tempfile.mkdtemp(prefix="bench_disk_tier_")
    load_before = wait_for_quiet(args.wait_load, args.wait_max) if args.wait_load is not None else list(os.getloadavg())
    plane = -(-args.layers_per_chunk * args.width ** 2 * 4 // args.world_size // 4096) * 4096
    try:
        disk_before = measure_disk(args.path, block_bytes=plane, total_bytes=args.disk_total)
        results = {}
        for system in args.systems:
            one = argparse.Namespace(**{**vars(args), "systems": [system]})
            results.update(launch(one, target=worker))
            print(f"{system:10s} median step {statistics.median(results[system]['step_s']):.3f} s", flush=True)
        disk_after = measure_disk(args.path, block_bytes=plane, total_bytes=args.disk_total)
        left = sorted(os.listdir(args.path))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    disk = {"before": disk_row(disk_before), "after": disk_row(disk_after),
            "read_bytes_per_s": (disk_before.read_bytes_per_s + disk_after.read_bytes_per_s) / 2,
            "write_bytes_per_s": (disk_before.write_bytes_per_s + disk_after.write_bytes_per_s) / 2}
    rows = summarise(results, disk, args)
    config = {k: getattr(args, k) for k in ("width", "layers", "layers_per_chunk", "batch", "seq_len", "warmup",
                                            "steps", "world_size", "threads", "keep_host_memory", "quick",
                                            "device")}
    config.update(path=str(args.path), temp_dir=scratch is not None, disk_total_bytes=args.disk_total,
                  optimizer="torch AdamW(fused=True), lr 1e-4, clip 1.0",
                  parameters=sum(p.numel() for p in DeepLM(args.width, args.layers).parameters()))
    out = {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                       "load_before": load_before, "load_after": list(os.getloadavg())},
           "disk": disk, "config": config, "systems": rows, "files_left": left}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    print_table(out)
    print(f"results: {out_path}")


def print_table(out: dict) -> None:
    disk, rows = out["disk"], out["systems"]
    print(f"disk: read {disk['read_bytes_per_s'] / 1e6:.0f} MB/s, write {disk['write_bytes_per_s'] / 1e6:.0f} MB/s "
          f"(blocks {disk['before']['block_bytes'] / 2**10:.0f} KiB, O_DIRECT {disk['before']['direct']})")
    print(f"{'system':10s} {'median s':>9s} {'vs host':>8s} {'disk MB':>8s} {'peak RSS MiB':>13s}")
    for name, row in rows.items():
        ratio = row.get("step_ratio_to_host")
        print(f"{name:10s} {row['median_step_s']:9.3f} {ratio if ratio is not None else float('nan'):8.2f} "
              f"{row.get('disk_state_bytes', 0) / 1e6:8.0f} {row['peak_rss_bytes'] / 2**20:13.0f}")
    t = rows.get("disk_half", {}).get("traffic")
    if t:
        print(f"one step's disk traffic: {t['read_bytes_per_step'] / 1e6:.0f} MB read + "
              f"{t['written_bytes_per_step'] / 1e6:.0f} MB written; in flight {t['io_busy_s_per_step']:.3f} s: "
              f"{t['io_efficiency']:.2f}x the measured bandwidth (reads {t['read_efficiency']:.2f}x, "
              f"writes {t['write_efficiency']:.2f}x); over the step's wall {t['wall_efficiency']:.2f}x")
        row = rows["disk_half"]
        if "weights_match_host" in row:
            print(f"disk tier equals host tier: weights {row['weights_match_host']}, losses {row['losses_match_host']}")


if __name__ == "__main__":
    main()
