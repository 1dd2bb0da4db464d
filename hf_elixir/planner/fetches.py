"""A replay of the runtime's fetching over a traced step: which gathers each fetch starts,
on demand or ahead of use, and which earlier gathers it waits for.

The runtime decides every gather from the request sequence alone (``runtime/fetch.py``
with the rCache of ``runtime/cache.py``), so the planner can make the same decisions
without running anything, and both the bytes a step moves (``traffic``) and when each
gather runs (``cost.simulate``) follow from one replay. It mirrors these rules:

- a fetch gathers every stale chunk it needs and waits for those a prefetch started;
- to free a block it evicts stale blocks before gathered ones, never a pinned chunk or one
  in flight, and among those the chunk whose next request lies furthest ahead (on the
  recorded trace) or the least recently used one (while recording);
- after each fetch it starts gathers for the next ``prefetch`` distinct chunks that are
  neither gathered nor in flight, looking 64 requests ahead, evicting only a chunk that is
  needed later than the prefetched one (and stopping at the first it cannot place);
- an optimizer step marks every trainable chunk stale, keeps the blocks and prefetches the
  first chunks of the next pass; a frozen chunk cannot change, so one still gathered (or
  being gathered) then stays so, and the next pass finds it without a gather
  (``Fetcher.release_all(keep_frozen=True)``).

The first pass records the trace (no prefetch, least-recently-used eviction); the replay
repeats passes until one starts as the previous did and returns that steady-state step.

At world size 1 a chunk whose shard lives on the compute device is its own block
(``in_place``): it takes no rCache block and moving it costs nothing, so the replay leaves
it out of every gather list.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Mapping, Sequence

#: how many requests ahead the runtime looks for chunks to prefetch (``RCache.upcoming``)
PREFETCH_WINDOW = 64
#: passes replayed at most before the steady state is taken as reached
MAX_PASSES = 5

_RELEASED, _IN_FLIGHT, _GATHERED = 0, 1, 2


@dataclass
class Fetch:
    """One fetch (a module's chunks pinned before its forward or its backward)."""

    event: int                  # the traced event whose compute follows this fetch
    demand: tuple[int, ...]     # gathered now; the fetch waits for them
    waits: tuple[int, ...]      # gathers started earlier (prefetches) that it waits for now
    ahead: tuple[int, ...]      # prefetches it starts once its own chunks are ready


@dataclass
class FetchReplay:
    """The steady-state step of the replay."""

    carried: tuple[int, ...]          # gathers the previous optimizer step started for this step
    fetches: list[Fetch] = field(default_factory=list)
    gathers: list[int] = field(default_factory=list)  # per chunk: gathers started per step
    # at_events' answers: the search simulates one replay under several placements
    _by_event: dict = field(default_factory=dict, repr=False, compare=False)

    def at_events(self, n_events: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """Per traced event: chunks gathered on demand, chunks waited for, chunks prefetched
        (the fetches that belong to it merged in order). Computed once per ``n_events``: a
        replay is not changed after it is made, and the lists are only read."""
        if n_events not in self._by_event:
            self._by_event[n_events] = self._at_events(n_events)
        return self._by_event[n_events]

    def _at_events(self, n_events: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        demand: list[list[int]] = [[] for _ in range(n_events)]
        waits: list[list[int]] = [[] for _ in range(n_events)]
        ahead: list[list[int]] = [[] for _ in range(n_events)]
        for f in self.fetches:
            e = min(f.event, n_events - 1)
            demand[e] += f.demand
            waits[e] += f.waits
            ahead[e] += f.ahead
        return demand, waits, ahead


@dataclass
class _Op:
    pin: bool
    cids: tuple[int, ...]
    event: int


@dataclass
class Requests:
    """A traced step's pins and unpins as chunk requests (``fetch_ops``), with what every
    replay of them looks up: the request order, each chunk's positions in it and the
    distinct chunks of each prefetch window. Built once per chunk packing."""

    ops: list[_Op]
    n_chunks: int

    @functools.cached_property
    def order(self) -> list[int]:
        return [c for op in self.ops if op.pin for c in op.cids]

    @functools.cached_property
    def positions(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.n_chunks)]
        for i, c in enumerate(self.order):
            out[c].append(i)
        return out

    @functools.cached_property
    def windows(self) -> list[list[tuple[int, int]]]:
        """Per position: the distinct chunks requested in the ``PREFETCH_WINDOW`` requests
        from there, in order, each at its first position."""
        order = self.order
        out = []
        for pos in range(len(order) + 1):
            seen: dict[int, int] = {}
            for q in range(pos, min(len(order), pos + PREFETCH_WINDOW)):
                seen.setdefault(order[q], q)
            out.append(list(seen.items()))
        return out


def fetch_ops(pins: Sequence[tuple[str, str]], module_params: Mapping[str, Sequence[str]],
              chunk_of: Mapping[str, int], n_chunks: int,
              events: Sequence[tuple[str, str]] | None = None) -> Requests:
    """The traced pin sequence (``Trace.pins``) as chunk requests. A pin that opens a
    traced event (``Trace.events``: the event is recorded just before its pin) belongs to
    it; a pin without one (a recomputed call's backward) belongs to the event after it."""
    ops: list[_Op] = []
    k = 0
    for op, module in pins:
        cids = tuple(sorted({chunk_of[p] for p in module_params.get(module, ()) if p in chunk_of}))
        if op == "pin" and events is not None and k < len(events) and events[k][1] == module:
            ops.append(_Op(True, cids, k))
            k += 1
        else:
            ops.append(_Op(op == "pin", cids, k))
    return Requests(ops, n_chunks)


class _Runtime:
    """The fetch state of the runtime between requests."""

    def __init__(self, requests: Requests, blocks: int, prefetch: int, in_place: frozenset[int],
                 frozen: frozenset[int] = frozenset()) -> None:
        n = requests.n_chunks
        self.requests, self.blocks, self.prefetch, self.in_place = requests, blocks, prefetch, in_place
        self.frozen = frozen
        self.status = [_RELEASED] * n
        self.resident: set[int] = set()
        self.pins = [0] * n
        self.last_used = [0] * n
        self.tick = 0
        self.cursor = -1
        self.on_trace = False
        self.gathers = [0] * n

    def next_use(self, c: int) -> float:
        pos = self.requests.positions[c]
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
                for c in flying:  # finish them: then they can go
                    self.status[c] = _GATHERED
                    waits.append(c)
                continue
            self.evict(max(choices, key=self.score))

    def fetch(self, cids: Sequence[int]) -> tuple[list[int], list[int]]:
        demand: list[int] = []
        waits: list[int] = []
        for c in cids:
            if self.on_trace:  # while recording, the trace has no position yet
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
        status, in_place = self.status, self.in_place
        for c, pos in self.requests.windows[self.cursor + 1]:  # the first ``prefetch`` to gather
            if status[c] == _RELEASED and c not in in_place:
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
        """The optimizer step: every trainable chunk stale (frozen ones keep their state),
        blocks kept; then the next pass's prefetch."""
        self.status = [s if c in self.frozen else _RELEASED for c, s in enumerate(self.status)]
        self.pins = [0] * len(self.pins)
        self.on_trace, self.cursor = True, -1
        return tuple(self.prefetch_ahead())

    def snapshot(self) -> tuple:
        return tuple(self.status), frozenset(self.resident)


def replay(requests: Requests, blocks: int, prefetch: int, world_size: int,
           param_cpu: frozenset[int] | set[int] = frozenset(),
           frozen: frozenset[int] | set[int] = frozenset()) -> FetchReplay:
    """The steady-state step of the runtime's fetching for ``requests`` (``fetch_ops``)
    with ``blocks`` rCache blocks and prefetch depth ``prefetch``; ``param_cpu``: the
    chunks whose parameter shard lives in host memory; ``frozen``: the frozen chunks (not
    released by the optimizer step)."""
    n_chunks = requests.n_chunks
    in_place = frozenset(range(n_chunks)) - frozenset(param_cpu) if world_size == 1 else frozenset()
    rt = _Runtime(requests, blocks, prefetch, in_place, frozenset(frozen))
    seen: list[tuple] = []
    carried: tuple[int, ...] = ()
    result = FetchReplay(carried=())
    for _ in range(MAX_PASSES):
        start = (rt.snapshot(), carried)
        if start in seen:
            break
        seen.append(start)
        rt.gathers = [0] * n_chunks
        fetches: list[Fetch] = []
        for op in requests.ops:
            if not op.pin:
                for c in op.cids:
                    rt.pins[c] = max(0, rt.pins[c] - 1)
                continue
            if not op.cids:  # a module without chunked parameters fetches nothing
                continue
            demand, waits = rt.fetch(op.cids)
            ahead = rt.prefetch_ahead()
            fetches.append(Fetch(op.event, tuple(demand), tuple(waits), tuple(ahead)))
        gathered = list(rt.gathers)
        next_carried = rt.end_step()
        for c in next_carried:  # started by this step's optimizer step: counted in this step
            gathered[c] += 1
        result = FetchReplay(carried=carried, fetches=fetches, gathers=gathered)
        carried = next_carried
    return result
