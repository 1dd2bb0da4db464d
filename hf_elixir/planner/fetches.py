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

How it runs fast. The search replays a step of thousands of requests for every packing,
rCache size and prefetch depth it tries, and at most requests nothing happens: the chunk is
gathered already and no prefetch can start. So the replay jumps from one request where
something may happen to the next and runs the rules above in full only there; in between
only the cursor moves. Something may happen at the next request of a chunk not gathered (a
gather on demand, or a wait for a prefetch) and, with prefetch, once the first chunk to
prefetch is within the window, unless every block is taken, none is stale and each gathered
one is needed again before that chunk (then not before the fetch after the earliest of
those last uses). The pins held at each request do not depend on the cache (a pin counts
up, an unpin down), so they are worked out once per request sequence, as is the recording
pass of each rCache size, which never prefetches. Among blocks equally good to free (none
needed again this pass) the first in the resident set's order goes, as in the runtime; the
set is built by the same additions and removals, so it iterates in the same order.
``tests/planner_reference.py`` holds the request-by-request replay this one matches, and
``tests/test_planner_reference.py`` checks that it does.
"""

from __future__ import annotations

import bisect
import functools
import heapq
from dataclasses import dataclass, field
from typing import Mapping, Sequence

#: how many requests ahead the runtime looks for chunks to prefetch (``RCache.upcoming``)
PREFETCH_WINDOW = 64
#: passes replayed at most before the steady state is taken as reached
MAX_PASSES = 5

_RELEASED, _IN_FLIGHT, _GATHERED = 0, 1, 2
_NEVER = float("inf")  # the next use of a chunk not requested again this pass


@dataclass
class Fetch:
    """One fetch (a module's chunks pinned before its forward or its backward)."""

    event: int                  # the traced event whose compute follows this fetch
    demand: tuple[int, ...]     # gathered now; the fetch waits for them
    waits: tuple[int, ...]      # gathers started earlier (prefetches) that it waits for now
    ahead: tuple[int, ...]      # prefetches it starts once its own chunks are ready


@dataclass
class _Op:
    pin: bool
    cids: tuple[int, ...]
    event: int


@dataclass
class Requests:
    """A traced step's pins and unpins as chunk requests (``fetch_ops``), with what every
    replay of them looks up, built once per chunk packing: the fetches (pins of at least
    one chunk) and their events, the request order, each chunk's positions in it, and the
    chunks pinned before and after each fetch."""

    ops: list[_Op]
    n_chunks: int

    @functools.cached_property
    def fetches(self) -> list[_Op]:
        """The pins that request chunks: one fetch each."""
        return [op for op in self.ops if op.pin and op.cids]

    @functools.cached_property
    def order(self) -> list[int]:
        return [c for op in self.fetches for c in op.cids]

    @functools.cached_property
    def starts(self) -> list[int]:
        """Per fetch, the position of its first request in ``order``."""
        out, at = [], 0
        for op in self.fetches:
            out.append(at)
            at += len(op.cids)
        return out

    @functools.cached_property
    def fetch_at(self) -> list[int]:
        """Per position in ``order``, the fetch that requests it."""
        return [k for k, op in enumerate(self.fetches) for _ in op.cids]

    @functools.cached_property
    def positions(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.n_chunks)]
        for i, c in enumerate(self.order):
            out[c].append(i)
        return out

    @functools.cached_property
    def recorded(self) -> dict[tuple, tuple]:
        """The first (recording) pass of each replay, by (blocks, in place, frozen): it never
        prefetches, so replays that differ in prefetch depth alone share it (``_Runtime.record``)."""
        return {}

    @functools.cached_property
    def pinned(self) -> tuple[list[frozenset[int]], list[frozenset[int]]]:
        """Per fetch, the chunks pinned just before it and just after it. A pass starts with
        nothing pinned, a pin counts up whatever the cache holds and an unpin counts down (not
        below zero), so this is the same for every replay of the requests."""
        pins = [0] * self.n_chunks
        held: frozenset[int] = frozenset()
        before: list[frozenset[int]] = []
        after: list[frozenset[int]] = []
        for op in self.ops:
            if op.pin:
                if not op.cids:
                    continue
                before.append(held)
                for c in op.cids:
                    pins[c] += 1
                held = held.union(op.cids)
                after.append(held)
            else:
                emptied = False
                for c in op.cids:
                    if pins[c]:  # an unpin never counts below zero
                        pins[c] -= 1
                        emptied = emptied or not pins[c]
                if emptied:
                    held = frozenset(c for c in held if pins[c])
        return before, after


@dataclass
class FetchReplay:
    """The steady-state step of the replay: the gathers the previous optimizer step started
    for it (``carried``), per chunk the gathers it starts (``gathers``), and the fetches that
    gather, wait or prefetch (``changes``: fetch index, demand, waits, ahead); every other
    fetch of ``requests`` does nothing."""

    carried: tuple[int, ...]
    gathers: list[int] = field(default_factory=list)
    changes: list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    requests: Requests | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def fetches(self) -> list[Fetch]:
        """Every fetch of the step, in order, those that do nothing included."""
        if self.requests is None:
            return []
        changed = {k: (demand, waits, ahead) for k, demand, waits, ahead in self.changes}
        return [Fetch(op.event, *changed.get(k, ((), (), ()))) for k, op in enumerate(self.requests.fetches)]

    def by_event(self, n_events: int) -> dict[int, tuple[list[int], list[int], list[int]]]:
        """Per traced event where some fetch gathers, waits or prefetches: the chunks
        gathered on demand, waited for and prefetched (its fetches merged in order; a fetch
        past the last event counts in it)."""
        ops = self.requests.fetches if self.requests is not None else []
        out: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for k, demand, waits, ahead in self.changes:
            lists = out.setdefault(min(ops[k].event, n_events - 1), ([], [], []))
            lists[0].extend(demand)
            lists[1].extend(waits)
            lists[2].extend(ahead)
        return out


def fetch_ops(pins: Sequence[tuple[str, str]], module_params: Mapping[str, Sequence[str]],
              chunk_of: Mapping[str, int], n_chunks: int,
              events: Sequence[tuple[str, str]] | None = None) -> Requests:
    """The traced pin sequence (``Trace.pins``) as chunk requests. A pin that opens a
    traced event (``Trace.events``: the event is recorded just before its pin) belongs to
    it; a pin without one (a recomputed call's backward) belongs to the event after it."""
    ops: list[_Op] = []
    k = 0
    cids_of: dict[str, tuple[int, ...]] = {}  # a module's chunks: the same at every pin
    for op, module in pins:
        cids = cids_of.get(module)
        if cids is None:
            cids = cids_of[module] = tuple(sorted({chunk_of[p] for p in module_params.get(module, ())
                                                   if p in chunk_of}))
        if op == "pin" and events is not None and k < len(events) and events[k][1] == module:
            ops.append(_Op(True, cids, k))
            k += 1
        else:
            ops.append(_Op(op == "pin", cids, k))
    return Requests(ops, n_chunks)


class _Runtime:
    """The fetch state of the runtime between requests, and the rules that change it.

    ``cursor`` is the position (in ``Requests.order``) of the latest request. Each chunk's
    previous and next request around it (``last``, ``next``) are brought up to date only
    when a choice of a block to free reads them (``_catch_up``; chunks in place never hold
    one). Two heaps, keyed by next request, hold the
    chunks not gathered (``waiting``: the next fetch of one does something) and the ones
    a prefetch may start (``wanted``: released, not in place); an entry is current while
    its chunk's ``version`` is the one it was pushed with."""

    def __init__(self, requests: Requests, blocks: int, prefetch: int, in_place: frozenset[int],
                 frozen: frozenset[int] = frozenset()) -> None:
        n = requests.n_chunks
        self.requests, self.blocks, self.prefetch, self.in_place = requests, blocks, prefetch, in_place
        self.frozen = frozen
        self.status = [_RELEASED] * n
        self.resident: set[int] = set()
        self.log: list[int] | None = None  # while recording: blocks taken (c) and freed (~c)
        self.stale = 0  # resident chunks that are released (blocks the optimizer step left)
        self.cursor = -1
        self.on_trace = False
        self.gathers = [0] * n
        self.version = [0] * n
        self._restart()

    # ------------------------------------------------------------------ bookkeeping
    def _restart(self) -> None:
        """A pass begins: no request made yet; the heaps rebuilt from the chunks' states."""
        positions = self.requests.positions
        self.cursor = -1
        self.next: list[float] = [p[0] if p else _NEVER for p in positions]
        self.last = [-1] * len(positions)
        # only a chunk that takes a block is ever chosen among blocks: the others need no watch
        self.watch = [(p, c) for c, p in enumerate(self.next) if p != _NEVER and c not in self.in_place]
        heapq.heapify(self.watch)
        self.waiting = [(self.next[c], self.version[c], c) for c, s in enumerate(self.status) if s != _GATHERED]
        self.wanted = [e for e in self.waiting if self.status[e[2]] == _RELEASED and e[2] not in self.in_place]
        heapq.heapify(self.waiting)
        heapq.heapify(self.wanted)
        self.stale = sum(1 for c in self.resident if self.status[c] == _RELEASED)

    def _catch_up(self) -> None:
        """``last`` and ``next`` of every chunk requested since they were last brought up to
        date: the chunks whose next request the cursor has reached."""
        watch, cursor = self.watch, self.cursor
        if not watch or watch[0][0] > cursor:
            return
        positions, last, nxt = self.requests.positions, self.last, self.next
        while watch and watch[0][0] <= cursor:
            _, c = heapq.heappop(watch)
            pos = positions[c]
            i = bisect.bisect_right(pos, cursor)
            last[c] = pos[i - 1]
            if i < len(pos):
                nxt[c] = pos[i]
                heapq.heappush(watch, (pos[i], c))
            else:
                nxt[c] = _NEVER

    def _admit(self, c: int) -> None:
        self.resident.add(c)
        if self.log is not None:
            self.log.append(c)

    def _evict(self, c: int) -> None:
        """Free ``c``'s block: released, into the heaps (its next request is current)."""
        if self.status[c] == _RELEASED:
            self.stale -= 1
        self.resident.discard(c)
        if self.log is not None:
            self.log.append(~c)
        self.status[c] = _RELEASED
        self.version[c] += 1
        entry = (self.next[c], self.version[c], c)
        heapq.heappush(self.waiting, entry)
        if c not in self.in_place:
            heapq.heappush(self.wanted, entry)

    def _next_waiting(self) -> float:
        """The next request of a chunk not gathered."""
        waiting, status, version = self.waiting, self.status, self.version
        while waiting:
            pos, v, c = waiting[0]
            if status[c] != _GATHERED and version[c] == v:
                return pos
            heapq.heappop(waiting)
        return _NEVER

    def _first_wanted(self) -> tuple[int, int] | None:
        """The released chunk (not in place) requested soonest, with its next request."""
        wanted, status, version = self.wanted, self.status, self.version
        while wanted:
            pos, v, c = wanted[0]
            if status[c] == _RELEASED and version[c] == v:
                return c, pos
            heapq.heappop(wanted)
        return None

    def _wanted(self, until: int, count: int) -> list[tuple[int, int]]:
        """Up to ``count`` released chunks (not in place) requested by position ``until``,
        the soonest first, each with its next request: what a prefetch wants."""
        first = self._first_wanted()
        if first is None or first[1] > until:
            return []
        if count == 1:
            return [first]
        wanted, status, version = self.wanted, self.status, self.version
        out: list[tuple[int, int]] = []
        kept = []
        while wanted and len(out) < count and wanted[0][0] <= until:
            entry = heapq.heappop(wanted)
            pos, v, c = entry
            if status[c] == _RELEASED and version[c] == v:
                out.append((c, pos))
                kept.append(entry)
        for entry in kept:
            heapq.heappush(wanted, entry)
        return out

    # ------------------------------------------------------------------ the runtime's rules
    def _victim(self, exclude: Sequence[int], pinned: frozenset[int]) -> int | None:
        """The block to free, among the resident ones not pinned, in flight or in ``exclude``,
        stale ones first: the one needed furthest ahead on the trace, or the least recently
        used one while recording; the first such in the resident set's order. None: none can go."""
        self._catch_up()
        status, resident = self.status, self.resident
        # furthest next request; while recording, the oldest last one (max and min both
        # return the first best in iteration order)
        best, key = (max, self.next.__getitem__) if self.on_trace else (min, self.last.__getitem__)
        if not self.stale and resident:
            # the best of all resident blocks, when it may go, is the best of those that may
            c = best(resident, key=key)
            if c not in pinned and status[c] != _IN_FLIGHT and c not in exclude:
                return c
        ready = [c for c in resident if c not in pinned and status[c] != _IN_FLIGHT and c not in exclude]
        stale = [c for c in ready if status[c] == _RELEASED] if self.stale else []
        choices = stale or ready
        return best(choices, key=key) if choices else None

    def _make_room(self, exclude: Sequence[int], waits: list[int], pinned: frozenset[int]) -> None:
        while len(self.resident) >= self.blocks:
            victim = self._victim(exclude, pinned)
            if victim is None:
                flying = [c for c in self.resident if self.status[c] == _IN_FLIGHT]
                if not flying:
                    raise ValueError(f"{self.blocks} rCache blocks cannot hold the chunks in use")
                for c in flying:  # finish them: then they can go
                    self.status[c] = _GATHERED
                    waits.append(c)
                continue
            self._evict(victim)

    def fetch(self, k: int) -> tuple[list[int], list[int]]:
        """Fetch ``k`` (an index into ``Requests.fetches``): gather what is released, wait
        for what is in flight."""
        requests = self.requests
        cids = requests.fetches[k].cids
        at = requests.starts[k]
        status = self.status
        demand: list[int] = []
        waits: list[int] = []
        for i, c in enumerate(cids):
            self.cursor = at + i
            if status[c] == _RELEASED:
                if c not in self.in_place:
                    if c not in self.resident:
                        self._make_room(cids, waits, requests.pinned[0][k])
                        self._admit(c)
                    else:
                        self.stale -= 1
                    demand.append(c)
                    self.gathers[c] += 1
            elif status[c] == _IN_FLIGHT:
                waits.append(c)
            status[c] = _GATHERED
        return demand, waits

    def prefetch_ahead(self, pinned: frozenset[int]) -> list[int]:
        """Start gathers for the next ``prefetch`` chunks that are released, within the window
        (on the trace only); ``pinned``: the chunks pinned now."""
        if not self.on_trace or self.prefetch <= 0:
            return []
        started: list[int] = []
        for c, pos in self._wanted(self.cursor + PREFETCH_WINDOW, self.prefetch):
            if c not in self.resident:
                if len(self.resident) >= self.blocks:
                    victim = self._victim((), pinned)
                    if victim is None or not self.next[victim] > pos:
                        break
                    self._evict(victim)
                self._admit(c)
            else:
                self.stale -= 1
            self.status[c] = _IN_FLIGHT
            self.gathers[c] += 1
            started.append(c)
        return started

    def end_step(self) -> tuple[int, ...]:
        """The optimizer step: every trainable chunk stale (frozen ones keep their state),
        blocks kept; then the next pass's prefetch."""
        self.status = [s if c in self.frozen else _RELEASED for c, s in enumerate(self.status)]
        self.on_trace = True
        self._restart()
        return tuple(self.prefetch_ahead(frozenset()))

    def snapshot(self) -> tuple:
        return tuple(self.status), frozenset(self.resident)

    # ------------------------------------------------------------------ skipping ahead
    def _next_prefetch(self) -> float:
        """A position at or before which the next prefetch that starts something follows
        its fetch (the fetch requesting it, or a later one, is the first that can)."""
        first = self._first_wanted()
        if first is None:
            return _NEVER
        c, pos = first
        start = max(pos - PREFETCH_WINDOW, self.cursor + 1)  # c comes within the window
        if start > self.cursor + 1 or c in self.resident or len(self.resident) < self.blocks or self.stale:
            return start
        # c is in the window, every block is taken, none stale: the prefetch is refused until
        # a gathered block is not needed again before c, and not pinned (as it is by the
        # fetch of its last use before c). More blocks than requests before c: one may go now
        cursor = self.cursor
        if len(self.resident) > pos - cursor:
            return start
        positions, status = self.requests.positions, self.status
        free = _NEVER
        for v in self.resident:
            if status[v] == _GATHERED:
                uses = positions[v]
                i = bisect.bisect_left(uses, pos)
                last = uses[i - 1] if i else -1
                if last <= cursor:  # not needed before c: may go now
                    return start
                if last < free:
                    free = last
        return _NEVER if free == _NEVER else max(start, free + 1)

    def run_pass(self) -> list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """One pass over the requests: (fetch index, demand, waits, ahead) of each fetch that
        gathers, waits or prefetches, in order."""
        requests = self.requests
        fetch_at, starts = requests.fetch_at, requests.starts
        after = requests.pinned[1]
        end = len(requests.order)
        changes = []
        prefetching = self.on_trace and self.prefetch > 0
        waiting, status, version = self.waiting, self.status, self.version
        while True:
            while waiting:  # the next request of a chunk not gathered (_next_waiting)
                at, v, c = waiting[0]
                if status[c] != _GATHERED and version[c] == v:
                    break
                heapq.heappop(waiting)
            else:
                at = _NEVER
            if prefetching:
                bound = self._next_prefetch()
                if bound < at:
                    at = bound
            if at >= end:
                break
            k = fetch_at[at]
            self.cursor = starts[k] - 1  # the requests before it changed nothing
            demand, waits = self.fetch(k)
            ahead = self.prefetch_ahead(after[k]) if prefetching else ()
            if demand or waits or ahead:
                changes.append((k, tuple(demand), tuple(waits), tuple(ahead)))
        return changes

    def record(self) -> list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """The first pass (``run_pass`` while recording), made once per (blocks, in place,
        frozen) and replayed from ``Requests.recorded`` after: the chunks' states, the gathers,
        and the resident set rebuilt by the same additions and removals, so it iterates in
        the same order and later ties are broken alike."""
        key = (self.blocks, self.in_place, self.frozen)
        made = self.requests.recorded.get(key)
        if made is None:
            self.log = []
            changes = self.run_pass()
            made = self.requests.recorded[key] = (tuple(self.status), tuple(self.log), tuple(self.gathers), changes)
            self.log = None
            return changes
        status, log, gathers, changes = made
        self.status, self.gathers = list(status), list(gathers)
        for x in log:
            if x >= 0:
                self.resident.add(x)
            else:
                self.resident.discard(~x)
        return changes


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
    result = FetchReplay(carried=(), requests=requests)
    for _ in range(MAX_PASSES):
        start = (rt.snapshot(), carried)
        if start in seen:
            break
        seen.append(start)
        rt.gathers = [0] * n_chunks
        changes = rt.run_pass() if rt.on_trace else rt.record()
        gathered = list(rt.gathers)
        next_carried = rt.end_step()
        for c in next_carried:  # started by this step's optimizer step: counted in this step
            gathered[c] += 1
        result = FetchReplay(carried=carried, gathers=gathered, changes=changes, requests=requests)
        carried = next_carried
    return result
