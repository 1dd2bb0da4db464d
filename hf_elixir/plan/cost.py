"""The cost model: predicted peak device memory and step time of one candidate plan.

Memory (per rank, on the compute device) mirrors what the runtime allocates:

=====================  ==========================================================================
parameter shards       chunks with param_placement "device": n * chunk_size/W * compute bytes
master weights         fp32 shard (4 B/element) per chunk whose optimizer runs on the device;
                       aliased with the parameter shard when the compute dtype is fp32
optimizer state        AdamW/Adam: exp_avg + exp_avg_sq (8 B/element); SGD: momentum (4 B/element)
gradients              fp32 gradient shard (4 B/element) per device-optimizer chunk, plus the
                       full-chunk gradient buffers (compute dtype) alive at once in backward
                       (``grad_buffer_chunks``: at least ``GRAD_BUFFER_CHUNKS``)
rCache                 rcache_blocks * chunk_size * compute bytes
activations            the profiler's peak of live activations and temporaries
frozen                 parameters that need no gradient and buffers, kept whole on the device
margin                 ``ALLOCATOR_MARGIN`` of all the above (fragmentation of the caching
                       allocator) plus the hardware's ``context_bytes`` (CUDA context, NCCL)
=====================  ==========================================================================

Time comes from a small event simulation of one step that follows the traced module order:
each module computes for its share of the step's FLOPs at the achievable matmul rate; the
chunks it needs that are not in the rCache (a Belady replay of the trace decides which) are
all-gathered on a communication stream that runs beside compute, issued ``prefetch_depth``
modules ahead (0: when the module is reached, so nothing overlaps); a chunk's gradient is
reduce-scattered on the same stream once its last backward user ran. Chunks whose optimizer
runs on the CPU copy their gradient shard to the host during backward; their updates start
when backward ends (clipping and the fp16 overflow check need every gradient) and run beside
the device optimizer, followed by a copy of the new compute-dtype shard back. Chunks whose
parameters live on the CPU pay a host-to-device copy on every gather. The step ends when both
the device optimizer and the CPU pipeline are done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from hf_elixir.hardware import HardwareProfile

#: fraction added to the predicted bytes for allocator fragmentation
ALLOCATOR_MARGIN = 0.05
#: full-chunk gradient buffers (compute dtype) alive at once during backward
GRAD_BUFFER_CHUNKS = 2
#: bytes per element of optimizer state
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------- packing
def pack(order: Sequence[str], sizes: dict[str, int], chunk_size: int) -> list[list[str]]:
    """Pack parameters, in first-use order, greedily into chunks of ``chunk_size`` elements.

    Keeping the order means the forward needs chunks one after another, so each is gathered
    once per pass; a parameter that does not fit the current chunk opens the next one.
    """
    chunks: list[list[str]] = []
    used = chunk_size
    for name in order:
        n = sizes[name]
        if n > chunk_size:
            raise ValueError(f"parameter {name!r} ({n} elements) exceeds chunk_size {chunk_size}")
        if used + n > chunk_size:
            chunks.append([])
            used = 0
        chunks[-1].append(name)
        used += n
    return chunks


def chunk_size_candidates(sizes: Iterable[int], world_size: int, limit: int = 8) -> list[int]:
    """Chunk sizes worth trying: from the largest parameter up to a few times it.

    Every size is a multiple of the world size (and of 64 elements when the model is large
    enough, for aligned shards). The ones with the least padding are kept.
    """
    sizes = list(sizes)
    largest, total = max(sizes), sum(sizes)
    align = world_size * (64 if largest >= 64 * 1024 else 1)

    def up(x: float) -> int:
        return int(math.ceil(x / align) * align)

    raw = {up(largest * f) for f in (1.0, 1.125, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)}
    raw.add(up(total))  # everything in one chunk (small models)
    for k in (2, 3, 4, 6, 8, 12, 16, 24, 32):  # an even split into k chunks
        if total / k >= largest:
            raw.add(up(total / k * 1.02))
    cands = sorted(s for s in raw if largest <= s <= max(up(total), up(largest)))

    def waste(s: int) -> float:
        used, n = s, 0
        for x in sizes:  # padding of a sequential greedy packing (order-independent estimate)
            if used + x > s:
                n += 1
                used = 0
            used += x
        return (n * s - total) / total

    scored = sorted(cands, key=lambda s: (round(waste(s), 3), s))
    keep = sorted(set(scored[:limit]) | {cands[0]})
    return keep


# ---------------------------------------------------------------------- access sequence
@dataclass
class Access:
    """One fetch event: a module in a phase, the chunks it needs, and its compute time."""

    phase: str
    module: str
    chunks: tuple[int, ...]
    seconds: float


def access_sequence(events, module_params, module_flops, param_chunk: dict[str, int],
                    step_flops: float, forward_flops: float, rate: float) -> list[Access]:
    """Turn the trace into chunk accesses with a compute time each.

    The step's FLOPs are spread over modules in proportion to the forward FLOPs the tracer
    attributed to them (modules without matmuls get a small floor), backward counting twice
    forward; the total matches the profiler's FLOP count.
    """
    base = {m: max(float(module_flops.get(m, 0)), 1.0) for m in module_params}
    weights = []
    for phase, m in events:
        w = base.get(m, 1.0)
        weights.append(2.0 * w if phase == "backward" else w)
    total_w = sum(weights) or 1.0
    seconds_total = step_flops / rate if rate > 0 else 0.0
    out = []
    for (phase, m), w in zip(events, weights):
        chunks = tuple(sorted({param_chunk[p] for p in module_params.get(m, []) if p in param_chunk}))
        out.append(Access(phase, m, chunks, seconds_total * w / total_w))
    return out


def max_span(module_params, param_chunk: dict[str, int]) -> int:
    """The most distinct chunks one module's own parameters span."""
    span = 1
    for params in module_params.values():
        span = max(span, len({param_chunk[p] for p in params if p in param_chunk}))
    return span


def grad_buffer_chunks(seq: Sequence[Access], n_chunks: int) -> int:
    """Full-chunk gradient buffers alive at once in backward.

    A chunk's buffer lives from the first backward access of any of its parameters until the
    last (then it is reduce-scattered and freed); tied weights used at both ends of the model
    keep theirs open across the whole backward. Two more cover the reductions in flight
    (the runtime's ledger shows up to two chunks finishing their reduce-scatter at once).
    """
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, a in enumerate(seq):
        if a.phase != "backward":
            continue
        for c in a.chunks:
            first.setdefault(c, i)
            last[c] = i
    best = 0
    for i in range(len(seq)):
        best = max(best, sum(1 for c in first if first[c] <= i <= last[c]))
    return max(GRAD_BUFFER_CHUNKS, best + 2)  # not capped at n_chunks: see the ledger


def belady_misses(seq: Sequence[Access], n_chunks: int, blocks: int) -> list[tuple[int, ...]]:
    """Replay the accesses against an rCache of ``blocks`` blocks with Belady eviction.

    Returns, for each access, the chunks that must be gathered before it. A chunk is never
    used again after its last access in the step (its next use is at infinity). Every
    chunk starts uncached (parameters changed in the last optimizer step).
    """
    positions: list[list[int]] = [[] for _ in range(n_chunks)]
    for i, a in enumerate(seq):
        for c in a.chunks:
            positions[c].append(i)
    ptr = [0] * n_chunks
    cache: set[int] = set()
    inf = len(seq) + 1
    out: list[tuple[int, ...]] = []

    def next_use(c: int) -> int:
        pos = positions[c]
        j = ptr[c]
        return pos[j] if j < len(pos) else inf

    for i, a in enumerate(seq):
        for c in a.chunks:
            ptr[c] += 1  # positions[c][ptr] is now the next use after i
        missing = [c for c in a.chunks if c not in cache]
        for c in missing:
            if len(cache) >= blocks:
                victims = [x for x in cache if x not in a.chunks]
                if not victims:  # cannot happen when blocks >= span
                    raise ValueError("rCache smaller than one module's chunks")
                cache.remove(max(victims, key=next_use))
            cache.add(c)
        out.append(tuple(missing))
    return out


# ---------------------------------------------------------------------- simulation
@dataclass
class SimResult:
    """One simulated step for a fixed (chunks, checkpointing, rCache, prefetch, param offload)."""

    backward_end: float
    compute: float
    comm_busy: float
    gathers: int
    gather_bytes: float
    rs_done: list[float]  # per chunk: when its reduce-scattered gradient shard is ready
    h2d_param_bytes: float


def simulate(seq: Sequence[Access], misses: Sequence[Sequence[int]], n_chunks: int,
             chunk_bytes: float, world_size: int, hw: HardwareProfile, prefetch: int,
             param_cpu: set[int] | frozenset = frozenset()) -> SimResult:
    """Event simulation of compute and the communication stream for one step."""
    W = world_size
    shard_bytes = chunk_bytes / W
    if W > 1:
        bw = hw.collective_rate(W)
        coll = hw.collective_latency + chunk_bytes * (W - 1) / W / bw
    else:  # one rank: a device-side copy of the chunk into/out of the cache block
        coll = chunk_bytes / hw.device_memory_bandwidth
    h2d = shard_bytes / hw.h2d_bandwidth

    last_bwd = [-1] * n_chunks
    for i, a in enumerate(seq):
        if a.phase == "backward":
            for c in a.chunks:
                last_bwd[c] = i
    finishing: list[list[int]] = [[] for _ in seq]
    for c, i in enumerate(last_bwd):
        if i >= 0:
            finishing[i].append(c)

    t = 0.0
    comm = 0.0
    busy = 0.0
    gathers = 0
    h2d_bytes = 0.0
    done = [0.0] * len(seq)
    issued = [False] * len(seq)
    rs_done = [0.0] * n_chunks

    def issue(e: int, at: float) -> None:
        nonlocal comm, busy, gathers, h2d_bytes
        issued[e] = True
        end = at
        for c in misses[e]:
            dur = coll + (h2d if c in param_cpu else 0.0)
            if c in param_cpu:
                h2d_bytes += shard_bytes
            start = max(comm, at)
            comm = start + dur
            busy += dur
            gathers += 1
            end = comm
        done[e] = end

    E = len(seq)
    compute = 0.0
    for e in range(E):
        if not issued[e]:
            issue(e, t)
        start = max(t, done[e])
        for f in range(e + 1, min(E, e + 1 + prefetch)):
            if not issued[f]:
                issue(f, start)
        t = start + seq[e].seconds
        compute += seq[e].seconds
        for c in finishing[e]:
            s = max(comm, t)
            comm = s + coll
            busy += coll
            rs_done[c] = comm
    for c in range(n_chunks):
        if last_bwd[c] < 0:  # never used in backward (unused parameters): reduced at the end
            s = max(comm, t)
            comm = s + coll
            busy += coll
            rs_done[c] = comm
    return SimResult(backward_end=max(t, comm), compute=compute, comm_busy=busy, gathers=gathers,
                     gather_bytes=gathers * chunk_bytes * (W - 1) / max(W, 1),
                     rs_done=rs_done, h2d_param_bytes=h2d_bytes)


def cpu_pipeline(rs_done: Sequence[float], backward_end: float, shard_elems: int,
                 compute_bytes: int, hw: HardwareProfile, ranks_per_node: int) -> list[float]:
    """End time of the CPU optimizer when the last k chunks are offloaded, for k = 0..n.

    Offloaded chunks are the tail of the packing order: their gradients are reduced first in
    backward, so their device->host copies overlap the rest of backward. The updates
    themselves cannot start before backward ends: global-norm clipping and the fp16 inf/NaN
    check need every gradient first. They then run beside the device optimizer. Each chunk:
    CPU AdamW (the host's throughput is shared by the node's ranks), then a host->device copy
    of the updated compute-dtype shard.
    """
    n = len(rs_done)
    d2h = shard_elems * compute_bytes / hw.d2h_bandwidth
    h2d = shard_elems * compute_bytes / hw.h2d_bandwidth
    cpu = shard_elems / (hw.cpu_adam_throughput / max(1, ranks_per_node))
    ends = [0.0]
    link = 0.0
    free = backward_end
    end = 0.0
    for j in range(n - 1, -1, -1):
        link = max(link, rs_done[j]) + d2h
        start = max(link, free)
        free = start + cpu
        end = max(end, free + h2d)
        ends.append(end)
    return ends


# ---------------------------------------------------------------------- memory
@dataclass
class MemoryBreakdown:
    parameters: float
    master_weights: float
    optimizer_state: float
    gradients: float
    rcache: float
    activations: float
    frozen: float
    margin: float = 0.0

    def total(self) -> float:
        return (self.parameters + self.master_weights + self.optimizer_state + self.gradients
                + self.rcache + self.activations + self.frozen + self.margin)

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": int(self.parameters),
            "master_weights": int(self.master_weights),
            "optimizer_state": int(self.optimizer_state),
            "gradients": int(self.gradients),
            "rcache": int(self.rcache),
            "activations": int(self.activations),
            "frozen_and_buffers": int(self.frozen),
            "margin": int(self.margin),
        }


def memory(n_chunks: int, chunk_size: int, world_size: int, compute_dtype: str, optimizer: str,
           rcache_blocks: int, n_optim_cpu: int, n_param_cpu: int, activation_bytes: float,
           frozen_bytes: float, context_bytes: float, grad_buffers: int | None = None) -> MemoryBreakdown:
    """Predicted peak device bytes per rank (see the module docstring for each category).

    Offloaded chunks are the last ``n_optim_cpu`` (optimizer) and last ``n_param_cpu``
    (parameters; always within the optimizer-offloaded ones).
    """
    cb = DTYPE_BYTES[compute_dtype]
    shard = chunk_size // world_size
    dev_params = n_chunks - n_param_cpu
    dev_optim = n_chunks - n_optim_cpu
    aliased = compute_dtype == "float32"
    m = MemoryBreakdown(
        parameters=dev_params * shard * cb,
        master_weights=0.0 if aliased else dev_optim * shard * 4,
        optimizer_state=dev_optim * shard * OPTIMIZER_STATE_BYTES[optimizer],
        gradients=dev_optim * shard * 4
        + (min(GRAD_BUFFER_CHUNKS, n_chunks) if grad_buffers is None else grad_buffers) * chunk_size * cb,
        rcache=rcache_blocks * chunk_size * cb,
        activations=activation_bytes,
        frozen=frozen_bytes,
    )
    m.margin = ALLOCATOR_MARGIN * m.total() + context_bytes
    return m
