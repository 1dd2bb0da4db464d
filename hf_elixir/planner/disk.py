"""The disk tier in the search: which chunks go to disk, what that costs, and whether it fits.

Host memory is a budget like device memory (``HardwareProfile.cpu_memory``, all the node's
ranks together). A candidate whose offloaded state does not fit it may still run if the
optimizer side of some of its offloaded chunks (fp32 master, optimizer state and fp32
gradient shard; their compute-dtype shards stay in host memory, as the runtime keeps them)
lives on disk (``optim_placement="disk"``, ``runtime/disk_tier.py``, ``disk_grads.py``). The search asks for
it only when a disk tier was named (``hfe.plan(..., nvme=True)``), and puts on disk only as
many chunks as host memory cannot hold, the trailing ones first (the offload levers' order).

Price: backward writes each disk chunk's gradient to its file, and the update reads the
chunk's planes (gradient included) and writes back all but the gradient: as many bytes
written as read, each step. The runtime overlaps the update's I/O with the host updates
(read-ahead and write-behind through a ring of ``RING`` buffers), so the step pays only
``max(0, disk time - host update time)``. The gradients' writes overlap backward's compute
in fact, but are priced with the rest (an upper bound). The disk is shared by the node's
ranks, so its time is the node's bytes over its bandwidth; reads and writes share the disk,
so their times add. One step is one micro-batch: with gradient accumulation every further
micro-batch also reads the gradients back before adding into them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from hf_elixir.hardware import HardwareProfile
from hf_elixir.planner.candidate import Candidate
from hf_elixir.planner.cost import REDUCTIONS_IN_FLIGHT
from hf_elixir.planner.record import PlanError
from hf_elixir.optimizers import MAX_STATE_PLANES, spec
from hf_elixir.vocab import format_bytes

#: host buffers of the runtime's ring (``runtime/disk_tier.DiskTier``'s default), each as
#: large as the largest chunk's planes
RING = 3
#: gradient-plane buffers (``runtime/disk_grads.DiskGrads``): one per reduction in flight
GRAD_RING = REDUCTIONS_IN_FLIGHT + 2


def bytes_per_element(optimizer: str) -> int:
    """Disk bytes per element of a disk chunk's shard: its fp32 master, optimizer state
    and fp32 gradient. The runtime's tier lays its files out before the optimizer is known,
    so every chunk holds the table's most state planes (``optimizers.MAX_STATE_PLANES``, fp32
    each) whatever ``optimizer`` keeps (checked here, so that a name outside the table fails)."""
    spec(optimizer)
    return 4 + 4 * MAX_STATE_PLANES + 4


def host_bytes_per_element(optimizer: str) -> float:
    """Host bytes per element of an offloaded chunk's shard kept in memory: its fp32 master,
    ``optimizer``'s own state (the table's bytes) and fp32 gradient."""
    return 4 + spec(optimizer).state_bytes + 4


def kept_off_host(c: Candidate, W: int, optimizer: str) -> float:
    """Host bytes the disk chunks spare a rank (what they would take in memory), less the
    rings that stage them."""
    shard = c.chunk_size // W
    return c.n_optim_disk * shard * host_bytes_per_element(optimizer) - ring_bytes(c, W, optimizer)


def disk_bytes(c: Candidate, W: int, optimizer: str) -> int:
    """Disk bytes one rank's disk chunks take (every chunk counted full size, as the host
    budget counts them)."""
    return c.n_optim_disk * (c.chunk_size // W) * bytes_per_element(optimizer)


def ring_bytes(c: Candidate, W: int, optimizer: str) -> int:
    """Host memory the rings take on a rank with disk chunks."""
    shard = c.chunk_size // W
    return (RING * bytes_per_element(optimizer) + GRAD_RING * 4) * shard if c.n_optim_disk else 0


def disk_seconds(rank_bytes: float, ranks_per_node: int, hw: HardwareProfile) -> float:
    """One step's disk I/O: every rank's disk chunks read, and written (the gradient by
    backward, the rest after the update), on one disk."""
    node = rank_bytes * max(1, ranks_per_node)
    return node / hw.disk_read_bandwidth + node / hw.disk_write_bandwidth


def exposed(disk_s: float, overlap_s: float) -> float:
    """What the step waits for: the disk time the host updates beside it do not cover."""
    return max(0.0, disk_s - overlap_s)


def priced(c: Candidate, q: int, W: int, optimizer: str, hw: HardwareProfile) -> Candidate:
    """``c`` with its last ``q`` optimizer-offloaded chunks on disk, its step re-priced: the
    host updates end later by the exposed disk time, the device's end is unchanged."""
    out = replace(c, n_optim_disk=q, time=dict(c.time))
    if not q:
        return out
    io = disk_seconds(disk_bytes(out, W, optimizer), min(W, hw.gpus_per_node), hw)
    late = exposed(io, c.time.get("cpu_optimizer", 0.0))
    device_end = c.time["forward_backward"] + c.time["device_optimizer"]
    out.host_ready = c.host_ready + late
    exposed_cpu = max(0.0, out.host_ready - device_end)
    out.step_time = device_end + exposed_cpu
    out.time.update(disk_io=io, exposed_disk=late, exposed_cpu=exposed_cpu, step=out.step_time)
    return out


def fewest_on_disk(c: Candidate, with_disk: Callable[[int], Candidate],
                   fits: Callable[[Candidate], bool]) -> Optional[Candidate]:
    """``with_disk(q)`` for the least ``q`` (0 to ``c.n_optim_cpu``) that ``fits``, or None.

    Bisected, not scanned (a 13B search prices some 15,000 candidates with up to 40
    offloaded chunks each): the first disk chunk brings the rings, so it may need more host
    memory than none, but past it each further disk chunk only takes its state off the host,
    so whether a count fits changes once as it grows."""
    none = with_disk(0)
    if fits(none):
        return none
    lo, hi = 1, c.n_optim_cpu
    if hi < 1 or not fits(last := with_disk(hi)):
        return None
    while lo < hi:  # the least count in [lo, hi] that fits; ``last`` is hi's, which fits
        mid = (lo + hi) // 2
        d = with_disk(mid)
        if fits(d):
            hi, last = mid, d
        else:
            lo = mid + 1
    return last


def place(cands: list[Candidate], host_bytes, host_budget: float, W: int, optimizer: str,
          hw: HardwareProfile, budget: float) -> list[Candidate]:
    """Each candidate with the fewest trailing disk chunks that bring its offloaded state
    (``host_bytes(candidate)``, per node) within ``host_budget``; candidates that do not fit
    even with every offloaded optimizer on disk are dropped. With a known free disk space
    (``hw.disk_free``), candidates needing more are dropped too, and when that leaves no
    candidate within the device ``budget`` that host memory would allow, a ``PlanError`` says
    how much more disk is needed."""
    ranks = min(W, hw.gpus_per_node)
    out, short = [], []
    for c in cands:
        d = fewest_on_disk(c, lambda q: priced(c, q, W, optimizer, hw), lambda d: host_bytes(d) <= host_budget)
        if d is None:
            continue
        if hw.disk_free is not None and disk_bytes(d, W, optimizer) * ranks > hw.disk_free:
            short.append(d)
            continue
        out.append(d)
    if short and not any(c.peak <= budget for c in out) and any(c.peak <= budget for c in short):
        need = min(disk_bytes(c, W, optimizer) * ranks for c in short if c.peak <= budget)
        raise PlanError(
            f"no plan fits: the disk tier needs at least {format_bytes(need)} ({need} bytes) of free disk "
            f"per machine, but {format_bytes(hw.disk_free)} ({hw.disk_free} bytes) is available; "
            f"{format_bytes(need - hw.disk_free)} more is needed. Free space there, name a larger disk, "
            "or use more host memory or GPUs.")
    return out


def predictions(c: Candidate, W: int, optimizer: str, hw: HardwareProfile) -> dict:
    """The plan's ``predictions["disk"]``: the disk tier's chunks, bytes and traffic."""
    rank = disk_bytes(c, W, optimizer)
    ranks = min(W, hw.gpus_per_node)
    return {
        "chunks": c.n_optim_disk,
        "bytes_per_rank": rank,
        "bytes_per_node": rank * ranks,
        "ring_bytes_per_rank": ring_bytes(c, W, optimizer),
        # every disk chunk's planes read before its update; its gradient written by backward,
        # the others written back after the update
        "read_bytes_per_step": rank,
        "write_bytes_per_step": rank,
        "read_bandwidth": hw.disk_read_bandwidth,
        "write_bandwidth": hw.disk_write_bandwidth,
        "free_bytes": hw.disk_free,
        "seconds_per_step": c.time.get("disk_io", 0.0),
        "exposed_seconds": c.time.get("exposed_disk", 0.0),
    }
