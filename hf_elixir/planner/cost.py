"""The cost model: predicted peak device memory and step time of one candidate plan.

Memory (per rank, on the compute device) mirrors what the runtime allocates. Chunks are as
large as their contents (``layout_sizes``: parameters on 16-byte boundaries, the chunk
rounded to W alignments), not ``chunk_size``:

=====================  ==========================================================================
parameter shards       compute-dtype shards of the trainable chunks whose parameters live on the
                       device
frozen shards          compute-dtype shards of the frozen chunks on the device: nothing else (no
                       master, gradient or optimizer state); offloaded ones cost uploads only
master weights         fp32 shard (4 B/element) per chunk whose optimizer runs on the device;
                       aliased with the parameter shard when the compute dtype is fp32
optimizer state        AdamW/Adam: exp_avg + exp_avg_sq (8 B/element); SGD: momentum (4 B/element)
gradients              fp32 gradient shard (4 B/element) per device-optimizer chunk, plus the
                       full-chunk gradient buffers alive at the step's peak instant
rCache                 gathered blocks, made on first use and kept: the largest
                       ``rcache_blocks`` chunks at worst (at world size 1 only offloaded ones)
activations            the profiler's live activations and temporaries at the peak instant
buffers                buffers (and non-floating parameters), kept whole on every rank
margin                 ``allocator_margin``: 5% on CUDA (fragmentation of the caching
                       allocator), none on a CPU, plus the hardware's ``context_bytes``
=====================  ==========================================================================

Activations peak at the loss, gradient buffers later in backward; ``aligned_peak`` adds the
two at the same instant (per fetch event) rather than adding their separate peaks.

Time comes from a small event simulation of one step that follows the traced fetch order.
Between two fetch events the compute stream runs the operators the profiler saw there
(``EventWork``), priced by ``hf_elixir.planner.pricing.price``: each matmul at the measured rate
of a matmul its size, every other operator by the bytes it moves plus a cost per call,
scaled by the calibrated block efficiency. The runtime's own copies (a rank's shard into
the gathered block, parameter gradients into the chunk's gradient buffer) run on the
compute stream too. Chunks are all-gathered on a communication stream beside compute where
the runtime starts them (``hf_elixir.planner.fetches`` replays its fetching: on demand, or up to
``prefetch_depth`` chunks ahead of use); a chunk's gradient is reduced on the same stream
once its last backward user ran. On a CPU whose cores all run ranks, communication beside
compute slows compute by the share calibration found not to hide (``Links``). After
backward: on a GPU, chunks whose optimizer runs on the CPU copy their gradient shards down
and their updates run on the host behind the next forward (``host_steps``); on a CPU device clipping
and AdamW share the rank's cores (``after_backward``), and offloading costs no time: the
state is in host memory already. Frozen chunks are gathered like the others (an offloaded
one uploaded first) and take no part in anything after their use: no gradient copy, no
reduction, no optimizer; a frozen chunk still gathered when the step ends stays gathered
for the next pass (``fetches``).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Callable, Iterable, Sequence

from hf_elixir.hardware import HardwareProfile
from hf_elixir.planner.fetches import FetchReplay
from hf_elixir.planner.memory_model import (  # noqa: F401  the memory half, re-exported
    ALLOCATOR_MARGIN, MemoryBreakdown, aligned_peak, memory)
from hf_elixir.vocab import DTYPE_BYTES  # noqa: F401  (cost.DTYPE_BYTES, for the search)



def allocator_margin(hw: HardwareProfile) -> float:
    """The fragmentation margin for ``hw``'s allocator.

    CUDA's caching allocator keeps freed blocks in size-binned pools, so its reserved bytes
    run a few percent above the live tensors. PyTorch's CPU allocator has no cache (every free
    goes straight back to malloc), so on a CPU device the live bytes are the whole story.
    """
    return ALLOCATOR_MARGIN if hw.device_type == "cuda" else 0.0


# ---------------------------------------------------------------------- access sequence
@dataclass
class Access:
    """One fetch event: a module in a phase, the chunks it needs, and its compute time."""

    phase: str
    module: str
    chunks: tuple[int, ...]
    seconds: float


def access_sequence(events, module_params, work, param_chunk: dict[str, int],
                    price: Callable[[Any], float] | None) -> list[Access]:
    """Turn the trace into chunk accesses, each with the compute time of the operators that
    run from it until the next one (``price`` of the trace's ``EventWork``; None: ``work``
    holds those seconds already, priced once for every packing)."""
    out = []
    chunks_of: dict[str, tuple[int, ...]] = {}  # a module's chunks: the same at every event
    for (phase, m), w in zip(events, work):
        chunks = chunks_of.get(m)
        if chunks is None:
            chunks = chunks_of[m] = tuple(sorted({param_chunk[p] for p in module_params.get(m, [])
                                                  if p in param_chunk}))
        out.append(Access(phase, m, chunks, price(w) if price is not None else w))
    return out


def max_span(module_params, param_chunk: dict[str, int]) -> int:
    """The most distinct chunks one module's own parameters span."""
    span = 1
    for params in module_params.values():
        span = max(span, len({param_chunk[p] for p in params if p in param_chunk}))
    return span


# ---------------------------------------------------------------------- simulation
class _GradientBuffers:
    """The full-chunk gradient buffers of a simulated step (``buffer_spans``, ``grad_buffers``,
    ``adopted_at``): what ``SimResult`` reports and ``SimSetup`` works out once."""

    grad_buffers: list[float]
    buffer_spans: list[tuple[int, int]]
    adopted_at: dict[int, int]

    def buffers_of(self, chunks: Iterable[int], chunk_bytes: Sequence[float]) -> list[float]:
        """Per access, the bytes of gradient buffers alive among ``chunks`` only."""
        return buffer_bytes(self.buffer_spans, chunks, chunk_bytes, len(self.grad_buffers))

    def beyond_trace(self, buffers: Sequence[float], chunks: Iterable[int],
                     chunk_bytes: Sequence[float]) -> list[float]:
        """``buffers`` (of ``chunks``) less what the trace already counts as a temporary:
        an adopted gradient during the access that produces it. Added to the trace's live
        bytes, this counts each byte once; the ledger sees ``buffers`` itself."""
        out = list(buffers)
        for c in chunks:
            if c in self.adopted_at:
                out[self.adopted_at[c]] -= chunk_bytes[c]
        return out


@dataclass
class SimResult(_GradientBuffers):
    """One simulated step for a fixed (chunks, checkpointing, rCache, prefetch, param offload)."""

    backward_end: float
    compute: float
    comm_busy: float
    gathers: int
    gather_bytes: float
    rs_done: list[float]  # per chunk: when its reduce-scattered gradient shard is ready
    h2d_param_bytes: float
    runtime_copies: float = 0.0  # compute-stream time of the runtime's own copies
    grad_buffers: list[float] = field(default_factory=list)  # per access: bytes of gradient buffers alive
    buffer_spans: list[tuple[int, int]] = field(default_factory=list)  # per chunk: accesses [first, end)
    adopted_at: dict[int, int] = field(default_factory=dict)  # adopting chunk -> access it adopts in


def buffer_bytes(spans: Sequence[tuple[int, int]], chunks: Iterable[int], chunk_bytes: Sequence[float],
                 n_events: int) -> list[float]:
    """Per access, the bytes of the gradient buffers of ``chunks`` alive then; ``spans``
    gives each chunk's buffer lifetime as accesses ``[first, end)`` (first < 0: none)."""
    delta = [0.0] * (n_events + 1)
    for c in chunks:
        first, end = spans[c]
        if first >= 0:
            delta[first] += chunk_bytes[c]
            delta[end] -= chunk_bytes[c]
    out, run = [], 0.0
    for d in delta[:-1]:
        run += d
        out.append(run)
    return out


@dataclass
class Links:
    """What one collective or copy costs: the figures ``simulate`` prices chunks with."""

    latency: float     # seconds per collective call
    gather_per_byte: float  # seconds per byte of a chunk all-gathered (communication stream)
    reduce_per_byte: float  # seconds per byte of a chunk's gradient reduced
    h2d_per_byte: float     # seconds per byte copied host -> device (0 on a CPU device: no copy)
    gather_overlap: float   # share of a gather's time that hides behind compute beside it (0..1)
    reduce_overlap: float   # the same for a gradient reduction
    figs: Any = None        # the rank's ComputeFigures: the runtime's own copies are priced by them

    def gather(self, chunk_bytes: float) -> float:
        return self.latency + chunk_bytes * self.gather_per_byte if self.gather_per_byte else 0.0

    def reduce(self, chunk_bytes: float) -> float:
        return self.latency + chunk_bytes * self.reduce_per_byte if self.reduce_per_byte else 0.0

    @classmethod
    def of(cls, hw: HardwareProfile, world_size: int, figs) -> "Links":
        W = world_size
        if W > 1:  # a ring moves (W-1)/W of the chunk through each rank's link
            latency = hw.collective_latency
            gather = (W - 1) / W / hw.collective_rate(W)
            reduce = (W - 1) / W / hw.reduce_rate(W)
        else:  # one rank: the block is the shard, the gradient adds into it (no copy)
            latency = gather = reduce = 0.0
        # A GPU's copy engines and NCCL kernels run beside the compute kernels. On a CPU the
        # collectives run on the cores compute uses: idle cores take them whole, and on busy
        # ones the share calibration measured hides (``HardwareProfile.comm_overlap``).
        if hw.device_type == "cpu":
            cores = os.cpu_count() or 1
            idle = max(0.0, 1.0 - min(W, hw.gpus_per_node) * figs.threads / cores)
            g_overlap, r_overlap = (idle + (1.0 - idle) * hw.comm_overlap.get(kind, 0.0)
                                    for kind in ("gather", "reduce"))
        else:
            g_overlap = r_overlap = 1.0
        # an offloaded parameter shard is uploaded before its gather only where the device
        # has memory of its own: on a CPU device it is gathered from where it lies
        h2d = 0.0 if hw.device_type == "cpu" else 1.0 / hw.h2d_bandwidth
        return cls(latency=latency, gather_per_byte=gather, reduce_per_byte=reduce,
                   h2d_per_byte=h2d, gather_overlap=g_overlap, reduce_overlap=r_overlap, figs=figs)


#: reductions the runtime keeps pending before it completes the oldest (runtime/reduce.py)
REDUCTIONS_IN_FLIGHT = 2


def _overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total length of the intersection of two lists of disjoint intervals, each sorted."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class SimSetup(_GradientBuffers):
    """What ``simulate`` derives from the trace and the packing alone, never from the fetching
    or the placements: built once per (packing, checkpointing) by ``sim_setup`` and shared by
    every candidate simulated on it (the search simulates hundreds per packing)."""

    seconds: list[float]             # per access: its operators' compute time
    coll: list[float]                # per chunk: its gather on the communication stream
    red: list[float]                 # per chunk: its gradient reduction
    grad_copy: list[float]           # per chunk: parameter gradients into its buffer (compute stream)
    shard_copy: list[float]          # per chunk: a rank's shard into the gathered block
    finishing: dict[int, list[int]]  # access -> chunks whose last backward use it is
    unreduced: list[int]             # trainable chunks never used in backward: reduced at the end
    grad_buffers: list[float]        # per access: bytes of gradient buffers alive
    buffer_spans: list[tuple[int, int]]  # per chunk: accesses [first, end) its buffer lives
    adopted_at: dict[int, int]       # adopting chunk -> access it adopts in
    # schedule()'s answers, by replay (kept with it, so its id is not reused)
    _schedules: dict[int, tuple[FetchReplay, "_Schedule"]] = field(default_factory=dict, repr=False)

    def schedule(self, fetches: FetchReplay) -> "_Schedule":
        """The step's accesses under ``fetches`` as ``simulate`` walks them, made once per
        replay: the search simulates each replay under several placements, and only the
        gathers' durations change with the placement."""
        made = self._schedules.get(id(fetches))
        if made is None or made[0] is not fetches:
            made = self._schedules[id(fetches)] = (fetches, _Schedule.of(self, fetches))
        return made[1]


@dataclass
class _Schedule:
    """The accesses of one step where something starts, waits or ends (a gather on demand, a
    wait for a prefetch, a prefetch, a complete gradient; ``steps``), each with the run of
    quiet accesses before it, and the sums that do not depend on when anything runs.

    Each step is (seconds of the quiet accesses before it, chunks gathered on demand, chunks
    waited for, chunks prefetched, chunks whose gradient is complete, the access's compute
    time with the runtime's copies)."""

    steps: list[tuple[list[float], list[int], list[int], list[int], list[int], float]]
    tail: list[float]  # seconds of the quiet accesses after the last step
    compute: float     # compute-stream seconds, summed access by access in order
    copies: float      # of which the runtime's own copies

    @classmethod
    def of(cls, setup: SimSetup, fetches: FetchReplay) -> "_Schedule":
        seconds, finishing = setup.seconds, setup.finishing
        grad_copy, shard_copy = setup.grad_copy, setup.shard_copy
        E = len(seconds)
        by_event = fetches.by_event(E)
        carried = list(fetches.carried)
        works = list(seconds)  # per access: its compute, the runtime's copies included
        steps = []
        copies = 0.0
        todo = 0  # the first access not yet taken
        for e in sorted(set(by_event).union(finishing, [0] if carried and E else [])):
            demand, waits, ahead = by_event.get(e, _NOTHING)
            done = finishing.get(e, [])
            work = seconds[e]
            if done:  # gradients into their buffers
                work = work + sum([grad_copy[c] for c in done])
            if demand or ahead or (e == 0 and carried):  # shards into their blocks
                work = work + sum([shard_copy[c] for c in demand + ahead + (carried if e == 0 else [])])
            copies += work - seconds[e]
            works[e] = work
            steps.append((seconds[todo:e], demand, waits, ahead, done, work))
            todo = e + 1
        return cls(steps, seconds[todo:], _last(accumulate(works, initial=0.0)), copies)


def sim_setup(seq: Sequence[Access], chunk_bytes: Sequence[float], world_size: int, links: Links,
              adopted: set[int] | frozenset = frozenset(),
              frozen: set[int] | frozenset = frozenset()) -> SimSetup:
    """The placement-independent part of ``simulate`` (see there for the arguments)."""
    W = world_size
    n_chunks = len(chunk_bytes)
    E = len(seq)
    first_bwd = [-1] * n_chunks
    last_bwd = [-1] * n_chunks
    for i, a in enumerate(seq):
        if a.phase == "backward":
            for c in a.chunks:
                if c in frozen:
                    continue
                if first_bwd[c] < 0:
                    first_bwd[c] = i
                last_bwd[c] = i
    finishing: dict[int, list[int]] = {}  # event -> chunks whose last backward use it is
    for c, i in enumerate(last_bwd):
        if i >= 0:
            finishing.setdefault(i, []).append(c)
    figs = links.figs
    # a chunk's gradient buffer is a new allocation each step; the block a shard is copied
    # into is kept in the rCache
    grad_copy = [figs.copy_seconds(b, fresh=True) if figs and c not in adopted else 0.0
                 for c, b in enumerate(chunk_bytes)]
    shard_copy = [figs.copy_seconds(b / W, fresh=False) if figs and W > 1 else 0.0 for b in chunk_bytes]
    # The runtime keeps REDUCTIONS_IN_FLIGHT reductions pending and completes (frees) the
    # oldest when another is issued; the rest complete when backward ends.
    issued_at = sorted((last_bwd[c], c) for c in range(n_chunks) if last_bwd[c] >= 0)
    begin = [-1 if c in frozen else last_bwd[c] if c in adopted else first_bwd[c] for c in range(n_chunks)]
    spans_of = [(begin[c], E) for c in range(n_chunks)]
    for j, (e_issue, c) in enumerate(issued_at):
        if j + REDUCTIONS_IN_FLIGHT < len(issued_at):
            spans_of[c] = (begin[c], max(begin[c], issued_at[j + REDUCTIONS_IN_FLIGHT][0] + 1))
    return SimSetup(
        seconds=[a.seconds for a in seq],
        coll=[links.gather(b) for b in chunk_bytes], red=[links.reduce(b) for b in chunk_bytes],
        grad_copy=grad_copy, shard_copy=shard_copy, finishing=finishing,
        unreduced=[c for c in range(n_chunks) if last_bwd[c] < 0 and c not in frozen],
        grad_buffers=buffer_bytes(spans_of, range(n_chunks), chunk_bytes, E), buffer_spans=spans_of,
        adopted_at={c: last_bwd[c] for c in adopted if last_bwd[c] >= 0},
    )


def _last(values: Iterable[float]) -> float:
    """The last of ``values`` (an iterator run to its end at C speed)."""
    return deque(values, maxlen=1)[0]


_NOTHING: tuple[list[int], list[int], list[int]] = ([], [], [])


def simulate(seq: Sequence[Access], fetches: FetchReplay, chunk_bytes: Sequence[float],
             world_size: int, links: Links,
             param_cpu: set[int] | frozenset = frozenset(),
             adopted: set[int] | frozenset = frozenset(),
             frozen: set[int] | frozenset = frozenset(),
             setup: SimSetup | None = None) -> SimResult:
    """Event simulation of compute and the communication stream for one step.

    Gathers start where the runtime starts them (``fetches``, the replay of its fetching,
    ``hf_elixir.planner.fetches``): on demand at a fetch, which waits for them; ahead of use
    once a fetch has its chunks (prefetch), waited for by the fetch that needs them; and
    the first ones of the step at the previous optimizer step. Besides the model's own
    operators, the compute stream carries the runtime's copies: a rank's shard into the
    gathered block when its gather starts, and each chunk's parameter gradients into its
    full-chunk gradient buffer (read and written once) when its last backward user ran.
    Communication beside compute slows it by the share that does not hide
    (``Links.gather_overlap``, ``Links.reduce_overlap``).
    The buffer lives from the chunk's first backward use until the runtime completes its
    reduction, ``REDUCTIONS_IN_FLIGHT`` reductions later; ``grad_buffers`` holds their bytes
    per access for the memory model. ``chunk_bytes``: each chunk's size as laid out
    (``layout_sizes``) times the compute dtype's bytes.

    A chunk in ``adopted`` (``adopting_chunks``: exactly one parameter, e.g. a large
    embedding) takes autograd's gradient tensor as its buffer: no copy, and no buffer before
    the access that completes that gradient (its last backward use), where the trace already
    counts the tensor as a temporary (``beyond_trace``).

    A chunk in ``frozen`` is gathered like any other (uploaded first when it is in
    ``param_cpu``) but has no gradient: no buffer, no copy into one and no reduction.

    ``setup``: ``sim_setup`` of the same arguments, when the caller simulates many
    candidates on one packing. Most accesses start, wait for and end nothing: their compute
    runs back to back, summed in order at C speed (the same additions as one access at a
    time, so the same figures to the last bit); what does not depend on the placements is
    worked out once per replay (``SimSetup.schedule``).
    """
    W = world_size
    n_chunks = len(chunk_bytes)
    if setup is None:
        setup = sim_setup(seq, chunk_bytes, world_size, links, adopted, frozen)
    coll, red = setup.coll, setup.red
    carried = list(fetches.carried)

    comm = 0.0
    busy = 0.0
    gathers = 0
    h2d_bytes = 0.0
    gathered = 0.0
    ready = [0.0] * n_chunks  # when the latest gather of each chunk completes
    rs_done = [0.0] * n_chunks
    spans: dict[str, list[tuple[float, float]]] = {"gather": [], "reduce": []}
    computing: list[tuple[float, float]] = []
    # the compute intervals matter only where communication beside compute slows it
    overlapping = links.gather_overlap != 1.0 or links.reduce_overlap != 1.0

    def on_stream(kind: str, dur: float, at: float) -> float:
        nonlocal comm, busy
        start = max(comm, at)
        comm = start + dur
        busy += dur
        spans[kind].append((start, comm))
        return comm

    # a gather's time on the stream, an offloaded shard's upload included
    up = [b / W if c in param_cpu else 0.0 for c, b in enumerate(chunk_bytes)]
    dur_of = [coll[c] + up[c] * links.h2d_per_byte if c in param_cpu else coll[c] for c in range(n_chunks)]
    gather_spans = spans["gather"]

    def gather(chunks: Iterable[int], at: float) -> None:
        """Gathers of ``chunks`` queued on the stream at ``at``, one after another."""
        nonlocal comm, busy, gathers, h2d_bytes, gathered
        for c in chunks:
            if c in param_cpu:
                h2d_bytes += up[c]
            dur = dur_of[c]
            start = at if at > comm else comm  # max(comm, at)
            comm = start + dur
            busy += dur
            if overlapping:
                gather_spans.append((start, comm))
            ready[c] = comm
            gathers += 1
            gathered += chunk_bytes[c]

    gather(carried, 0.0)  # started by the previous step's optimizer step
    sched = setup.schedule(fetches)
    t = 0.0
    # the accesses where a gather starts, one is waited for or a gradient is complete, each
    # after a run of accesses that only compute: summed one after another as they run
    for run, demand, waits, ahead, done, work in sched.steps + [(sched.tail, [], [], [], [], None)]:
        if len(run) == 1:
            if overlapping:
                computing.append((t, t + run[0]))
            t += run[0]
        elif run:
            if overlapping:
                ends = list(accumulate(run, initial=t))
                computing.extend(zip(ends, ends[1:]))
                t = ends[-1]
            else:
                t = _last(accumulate(run, initial=t))
        if work is None:  # the quiet accesses after the last step
            break
        if demand:
            gather(demand, t)
        start = t  # once every chunk it needs is ready: max(t, ready of each)
        for c in demand:
            if ready[c] > start:
                start = ready[c]
        for c in waits:
            if ready[c] > start:
                start = ready[c]
        if ahead:
            gather(ahead, start)
        t = start + work
        if overlapping:
            computing.append((start, t))
        for c in done:
            rs_done[c] = on_stream("reduce", red[c], t)
    compute, copies = sched.compute, sched.copies
    for c in setup.unreduced:  # never used in backward: reduced at the end
        rs_done[c] = on_stream("reduce", red[c], t)
    end = max(t, comm)
    # communication the stream ran beside compute slowed compute by what did not hide
    # (a share that hides whole, as on a GPU, needs no intersection)
    slowed = [(1.0 - share) * _overlap(spans[kind], computing) if share != 1.0 else 0.0
              for kind, share in (("gather", links.gather_overlap), ("reduce", links.reduce_overlap))]
    end += slowed[0] + slowed[1]
    return SimResult(backward_end=end, compute=compute, comm_busy=busy, gathers=gathers,
                     gather_bytes=gathered * (W - 1) / max(W, 1),
                     rs_done=rs_done, h2d_param_bytes=h2d_bytes, runtime_copies=copies,
                     grad_buffers=setup.grad_buffers, buffer_spans=setup.buffer_spans,
                     adopted_at=setup.adopted_at)


def after_backward(shard_elems: float, figs, hw: HardwareProfile, world_size: int) -> float:
    """Compute-stream seconds from the end of backward to the end of the step on a rank
    whose optimizer shares its cores with compute (a CPU device): clipping reads every fp32
    gradient shard for the norm and rescales it, the fused AdamW updates every shard, and
    the gradient shards are zeroed. Where calibrated, the whole sequence is priced at its
    measured rate (``ComputeFigures.update_rate``): it runs on every rank at once, sharing
    the memory bus, which the separately measured rates leave out (they price it well below
    what two ranks sharing the bus take). Otherwise it is priced pass by pass.

    With several ranks three small all-reduces bracket it: the ranks agree on late chunks
    at the end of backward, the norm is summed, and the step agrees on which parameters got
    a gradient (``GradReducer.agreed_late``, ``clip_grad_norm_``, ``global_seen``).

    Offloading changes none of it: a CPU device's "offloaded" state is already in host
    memory, so the runtime copies nothing out or back (``traffic.step_traffic`` counts no
    host<->device bytes there either) and every shard updates on the same cores. In bf16 or
    fp16 an offloaded chunk's update does differ: the one-pass loop
    (``runtime/host_kernel.py``) writes the copy and takes the clipping's factor as it reads,
    with no scaling pass. It is priced at the one measured rate all the same, a small
    overestimate (that pass moved 8 of some 40 bytes an element) that a second calibration on
    every CPU machine would not repay: a CPU device trains only tiny models."""
    if figs.update_rate > 0:
        t = shard_elems / figs.update_rate
    else:
        grad_bytes = shard_elems * 4
        t = 3 * grad_bytes / figs.read_bandwidth  # the norm's read, the rescale, the zeroing
        t += shard_elems / figs.adam_rate
    if world_size > 1:
        t += 3 * hw.collective_latency
    return t
