"""The planner's replay and step simulation as they were before they were made fast,
request by request and event by event: the specification that ``hf_elixir.planner.fetches.replay``
and ``hf_elixir.planner.cost.simulate`` match to the last bit (``test_planner_reference.py``).

The replay runs the runtime's rules in full at every request: the fetch, then the prefetch
scan of the next ``PREFETCH_WINDOW`` requests, each eviction choosing among the resident
blocks by next use (least recent use while recording). The fast replay skips the requests
where nothing can change; this one shows that nothing it skips would have changed anything.
The simulation walks every traced event; the fast one runs the events where nothing starts,
waits or ends in bulk, and works out once per replay what does not depend on the placements.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from hf_elixir.planner.cost import REDUCTIONS_IN_FLIGHT, Access, Links, SimResult, _overlap, buffer_bytes
from hf_elixir.planner.fetches import MAX_PASSES, PREFETCH_WINDOW, Requests

_RELEASED, _IN_FLIGHT, _GATHERED = 0, 1, 2


class _Runtime:
    """The fetch state of the runtime between requests."""

    def __init__(self, requests: Requests, blocks: int, prefetch: int, in_place: frozenset[int],
                 frozen: frozenset[int] = frozenset()) -> None:
        n = requests.n_chunks
        self.blocks, self.prefetch, self.in_place, self.frozen = blocks, prefetch, in_place, frozen
        self.order = [c for op in requests.ops if op.pin for c in op.cids]
        self.positions: list[list[int]] = [[] for _ in range(n)]
        for i, c in enumerate(self.order):
            self.positions[c].append(i)
        self.status = [_RELEASED] * n
        self.resident: set[int] = set()
        self.pins = [0] * n
        self.last_used = [0] * n
        self.tick = 0
        self.cursor = -1
        self.on_trace = False
        self.gathers = [0] * n

    def window(self, pos: int) -> list[tuple[int, int]]:
        """The distinct chunks of the ``PREFETCH_WINDOW`` requests from ``pos``, each at its
        first position, in order."""
        seen: dict[int, int] = {}
        for q in range(pos, min(len(self.order), pos + PREFETCH_WINDOW)):
            seen.setdefault(self.order[q], q)
        return list(seen.items())

    def next_use(self, c: int) -> float:
        pos = self.positions[c]
        i = bisect.bisect_right(pos, self.cursor)
        return pos[i] if i < len(pos) else float("inf")

    def score(self, c: int) -> float:
        return self.next_use(c) if self.on_trace else -self.last_used[c]

    def evictable(self, exclude: Sequence[int] = ()) -> list[int]:
        ready = [c for c in self.resident
                 if self.pins[c] == 0 and self.status[c] != _IN_FLIGHT and c not in exclude]
        stale = [c for c in ready if self.status[c] == _RELEASED]
        return stale or ready

    def evict(self, c: int) -> None:
        self.status[c] = _RELEASED
        self.resident.discard(c)

    def make_room(self, exclude: Sequence[int], waits: list[int]) -> None:
        while len(self.resident) >= self.blocks:
            choices = self.evictable(exclude)
            if not choices:
                flying = [c for c in self.resident if self.status[c] == _IN_FLIGHT]
                if not flying:
                    raise ValueError(f"{self.blocks} rCache blocks cannot hold the chunks in use")
                for c in flying:
                    self.status[c] = _GATHERED
                    waits.append(c)
                continue
            self.evict(max(choices, key=self.score))

    def fetch(self, cids: Sequence[int]) -> tuple[list[int], list[int]]:
        demand: list[int] = []
        waits: list[int] = []
        for c in cids:
            if self.on_trace:
                self.cursor += 1
            self.tick += 1
            self.last_used[c] = self.tick
            if self.status[c] == _RELEASED:
                if c not in self.in_place:
                    if c not in self.resident:
                        self.make_room(cids, waits)
                        self.resident.add(c)
                    demand.append(c)
                    self.gathers[c] += 1
            elif self.status[c] == _IN_FLIGHT:
                waits.append(c)
            self.status[c] = _GATHERED
            self.pins[c] += 1
        return demand, waits

    def prefetch_ahead(self) -> list[int]:
        if not self.on_trace or self.prefetch <= 0:
            return []
        started: list[int] = []
        wanted: list[tuple[int, int]] = []
        for c, pos in self.window(self.cursor + 1):
            if self.status[c] == _RELEASED and c not in self.in_place:
                wanted.append((c, pos))
                if len(wanted) == self.prefetch:
                    break
        for c, pos in wanted:
            if c not in self.resident:
                if len(self.resident) >= self.blocks:
                    choices = self.evictable()
                    if not choices:
                        break
                    victim = max(choices, key=self.score)
                    if not self.score(victim) > pos:
                        break
                    self.evict(victim)
                self.resident.add(c)
            self.status[c] = _IN_FLIGHT
            self.gathers[c] += 1
            started.append(c)
        return started

    def end_step(self) -> tuple[int, ...]:
        self.status = [s if c in self.frozen else _RELEASED for c, s in enumerate(self.status)]
        self.pins = [0] * len(self.pins)
        self.on_trace, self.cursor = True, -1
        return tuple(self.prefetch_ahead())

    def snapshot(self) -> tuple:
        return tuple(self.status), frozenset(self.resident)


def replay(requests: Requests, blocks: int, prefetch: int, world_size: int,
           param_cpu: frozenset[int] | set[int] = frozenset(),
           frozen: frozenset[int] | set[int] = frozenset()) -> tuple:
    """(carried, [(event, demand, waits, ahead) per fetch], gathers) of the steady-state step."""
    n_chunks = requests.n_chunks
    in_place = frozenset(range(n_chunks)) - frozenset(param_cpu) if world_size == 1 else frozenset()
    rt = _Runtime(requests, blocks, prefetch, in_place, frozenset(frozen))
    seen: list[tuple] = []
    carried: tuple[int, ...] = ()
    result: tuple = ((), [], [])
    for _ in range(MAX_PASSES):
        start = (rt.snapshot(), carried)
        if start in seen:
            break
        seen.append(start)
        rt.gathers = [0] * n_chunks
        fetched = []
        for op in requests.ops:
            if not op.pin:
                for c in op.cids:
                    rt.pins[c] = max(0, rt.pins[c] - 1)
                continue
            if not op.cids:
                continue
            demand, waits = rt.fetch(op.cids)
            ahead = rt.prefetch_ahead()
            fetched.append((op.event, tuple(demand), tuple(waits), tuple(ahead)))
        gathered = list(rt.gathers)
        next_carried = rt.end_step()
        for c in next_carried:
            gathered[c] += 1
        result = (carried, fetched, gathered)
        carried = next_carried
    return result


def _at_events(fetched: list[tuple], n_events: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Per traced event: chunks gathered on demand, waited for and prefetched (the fetches
    that belong to it merged in order)."""
    demand: list[list[int]] = [[] for _ in range(n_events)]
    waits: list[list[int]] = [[] for _ in range(n_events)]
    ahead: list[list[int]] = [[] for _ in range(n_events)]
    for event, d, w, a in fetched:
        e = min(event, n_events - 1)
        demand[e] += d
        waits[e] += w
        ahead[e] += a
    return demand, waits, ahead


def simulate(seq: Sequence[Access], fetches: tuple, chunk_bytes: Sequence[float],
             world_size: int, links: Links,
             param_cpu: set[int] | frozenset = frozenset(),
             adopted: set[int] | frozenset = frozenset(),
             frozen: set[int] | frozenset = frozenset()) -> SimResult:
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
    """
    W = world_size
    n_chunks = len(chunk_bytes)
    E = len(seq)
    coll = [links.gather(b) for b in chunk_bytes]
    red = [links.reduce(b) for b in chunk_bytes]
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
    demand, waits, ahead = _at_events(fetches[1], E)

    comm = 0.0
    busy = 0.0
    gathers = 0
    h2d_bytes = 0.0
    gathered = 0.0
    copies = 0.0
    ready = [0.0] * n_chunks  # when the latest gather of each chunk completes
    rs_done = [0.0] * n_chunks
    spans: dict[str, list[tuple[float, float]]] = {"gather": [], "reduce": []}
    computing: list[tuple[float, float]] = []

    def on_stream(kind: str, dur: float, at: float) -> float:
        nonlocal comm, busy
        start = max(comm, at)
        comm = start + dur
        busy += dur
        spans[kind].append((start, comm))
        return comm

    def gather(c: int, at: float) -> None:
        nonlocal gathers, h2d_bytes, gathered
        dur = coll[c]
        if c in param_cpu:
            dur += chunk_bytes[c] / W * links.h2d_per_byte
            h2d_bytes += chunk_bytes[c] / W
        ready[c] = on_stream("gather", dur, at)
        gathers += 1
        gathered += chunk_bytes[c]

    figs = links.figs
    # a chunk's gradient buffer is a new allocation each step; the block a shard is copied
    # into is kept in the rCache
    grad_copy = [figs.copy_seconds(b, fresh=True) if figs and c not in adopted else 0.0
                 for c, b in enumerate(chunk_bytes)]
    shard_copy = [figs.copy_seconds(b / W, fresh=False) if figs and W > 1 else 0.0 for b in chunk_bytes]
    for c in fetches[0]:  # started by the previous step's optimizer step
        gather(c, 0.0)
    t = 0.0
    compute = 0.0
    for e in range(E):
        done = finishing.get(e, ())
        if not (demand[e] or waits[e] or ahead[e] or done or (e == 0 and fetches[0])):
            # nothing starts, waits or ends here: the event's own compute only (most events)
            work = seq[e].seconds
            computing.append((t, t + work))
            t += work
            compute += work
            continue
        for c in demand[e]:
            gather(c, t)
        start = max([t] + [ready[c] for c in demand[e] + waits[e]])
        for c in ahead[e]:
            gather(c, start)
        started = demand[e] + ahead[e] + (list(fetches[0]) if e == 0 else [])
        work = (seq[e].seconds + sum(grad_copy[c] for c in done)
                + sum(shard_copy[c] for c in started))
        copies += work - seq[e].seconds
        t = start + work
        computing.append((start, t))
        compute += work
        for c in done:
            rs_done[c] = on_stream("reduce", red[c], t)
    for c in range(n_chunks):
        if last_bwd[c] < 0 and c not in frozen:  # never used in backward: reduced at the end
            rs_done[c] = on_stream("reduce", red[c], t)
    end = max(t, comm)
    # communication the stream ran beside compute slowed compute by what did not hide
    # (a share that hides whole, as on a GPU, needs no intersection)
    slowed = [(1.0 - share) * _overlap(spans[kind], computing) if share != 1.0 else 0.0
              for kind, share in (("gather", links.gather_overlap), ("reduce", links.reduce_overlap))]
    end += slowed[0] + slowed[1]
    # The runtime keeps REDUCTIONS_IN_FLIGHT reductions pending and completes (frees) the
    # oldest when another is issued; the rest complete when backward ends.
    issued_at = sorted((last_bwd[c], c) for c in range(n_chunks) if last_bwd[c] >= 0)
    begin = [-1 if c in frozen else last_bwd[c] if c in adopted else first_bwd[c] for c in range(n_chunks)]
    spans_of = [(begin[c], E) for c in range(n_chunks)]
    for j, (e_issue, c) in enumerate(issued_at):
        if j + REDUCTIONS_IN_FLIGHT < len(issued_at):
            spans_of[c] = (begin[c], max(begin[c], issued_at[j + REDUCTIONS_IN_FLIGHT][0] + 1))
    buffers = buffer_bytes(spans_of, range(n_chunks), chunk_bytes, E)
    return SimResult(backward_end=end, compute=compute, comm_busy=busy, gathers=gathers,
                     gather_bytes=gathered * (W - 1) / max(W, 1),
                     rs_done=rs_done, h2d_param_bytes=h2d_bytes, runtime_copies=copies,
                     grad_buffers=buffers, buffer_spans=spans_of,
                     adopted_at={c: last_bwd[c] for c in adopted if last_bwd[c] >= 0})
