"""The rCache: at most ``capacity`` gathered chunks, with trace-driven (Belady) eviction.

The first training pass records the order in which chunks are requested (forward and
backward). Later passes follow that trace with a cursor; while the live requests match it,
the victim is the unpinned chunk whose next use lies furthest ahead, which is optimal for a
known sequence. When a request differs from the trace (dynamic control flow, generation,
evaluation) the rest of that pass evicts the least recently used chunk instead. Leaving
the trace is never an error.

Prefetches are collectives, so every rank must follow the same trace. The recorded trace is
compared across ranks once, when recording ends (``agree``: one small all-reduce); if any
rank recorded a different order, every rank drops it and the next pass records again.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class ChunkTrace:
    """A recorded request order with, per chunk, the positions where it is requested."""

    order: list[int]
    positions: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for pos, cid in enumerate(self.order):
            self.positions.setdefault(cid, []).append(pos)

    def next_use(self, cid: int, after: int) -> float:
        """First position > ``after`` where ``cid`` is requested (inf: never again)."""
        pos = self.positions.get(cid)
        if not pos:
            return float("inf")
        i = bisect.bisect_right(pos, after)
        return pos[i] if i < len(pos) else float("inf")


@dataclass
class CacheStats:
    requests: int = 0
    hits: int = 0
    gathers: int = 0
    evictions: int = 0
    prefetches: int = 0
    off_trace_passes: int = 0
    trace_disagreements: int = 0


class RCache:
    """Tracks which chunks are gathered and decides which to evict."""

    def __init__(self, capacity: int, agree: Optional[Callable[[list[int]], bool]] = None) -> None:
        self.capacity = capacity
        self.agree = agree  # whether every rank recorded this order (collective); None: one rank
        self.resident: set[int] = set()   # chunks holding a block (gathered or stale)
        self.last_used: dict[int, int] = {}
        self.tick = 0
        self.trace: Optional[ChunkTrace] = None
        self.recording: Optional[list[int]] = None
        self.cursor = -1          # position in the trace of the latest request
        self.on_trace = False
        self.stats = CacheStats()

    # ------------------------------------------------------------------ passes
    def begin_pass(self, record: bool) -> None:
        """A new forward(+backward) pass starts; the first training pass is recorded."""
        self.finish_recording()
        if self.trace is None and record:
            self.recording = []
        self.cursor = -1
        self.on_trace = self.trace is not None

    def finish_recording(self) -> None:
        """Adopt the recorded order as the trace, if every rank recorded the same one. Every
        rank records the same passes, so every rank reaches the agreement together."""
        recording, self.recording = self.recording, None
        if recording is None:
            return
        if self.agree is not None and not self.agree(recording):
            self.stats.trace_disagreements += 1
            return
        if recording:
            self.trace = ChunkTrace(recording)

    def note_request(self, cid: int) -> None:
        """Advance the trace cursor for a live request (or record it)."""
        self.stats.requests += 1
        self.tick += 1
        self.last_used[cid] = self.tick
        if self.recording is not None:
            self.recording.append(cid)
            return
        if not self.on_trace:
            return
        nxt = self.cursor + 1
        if nxt < len(self.trace.order) and self.trace.order[nxt] == cid:
            self.cursor = nxt
        else:
            self.on_trace = False
            self.stats.off_trace_passes += 1

    # ------------------------------------------------------------------ decisions
    @property
    def full(self) -> bool:
        return len(self.resident) >= self.capacity

    def _score(self, cid: int) -> float:
        """Higher is a better victim."""
        if self.on_trace:
            return self.trace.next_use(cid, self.cursor)
        return -self.last_used.get(cid, 0)

    def choose_victim(self, evictable: list[int], needed_at: float = float("inf")) -> Optional[int]:
        """The chunk to evict, or None. With ``needed_at`` (a trace position, for prefetch)
        only a chunk used later than that position qualifies."""
        if not evictable:
            return None
        victim = max(evictable, key=self._score)
        if needed_at != float("inf") and not (self.on_trace and self._score(victim) > needed_at):
            return None
        return victim

    def upcoming(self, depth: int, ready: Callable[[int], bool], window: int = 64) -> list[tuple[int, int]]:
        """The next ``depth`` distinct chunks the trace will request that are not ``ready``
        (already gathered or in flight), with their positions; looks ``window`` requests ahead."""
        if not self.on_trace or depth <= 0:
            return []
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        order = self.trace.order
        pos = self.cursor + 1
        stop = min(len(order), pos + window)
        while pos < stop and len(out) < depth:
            cid = order[pos]
            if cid not in seen:
                seen.add(cid)
                if not ready(cid):
                    out.append((cid, pos))
            pos += 1
        return out

    def admit(self, cid: int) -> None:
        """``cid`` now holds a block."""
        self.resident.add(cid)

    def evict(self, cid: int) -> None:
        self.resident.discard(cid)
        self.stats.evictions += 1

