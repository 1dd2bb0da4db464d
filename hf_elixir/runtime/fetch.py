"""Fetching chunks for the module about to run, and prefetching the next ones.

Every rank must issue the same all-gathers in the same order. Requests come from module
hooks, which fire in the same order on every rank (data-dependent modules are fetched as
one unit, see ElixirPlan.fetch_units), and every decision here (hit, eviction, prefetch)
depends only on that request sequence, so the collectives line up.
"""

from __future__ import annotations

import warnings
from typing import Collection, Sequence

import torch

from hf_elixir.runtime.cache import RCache
from hf_elixir.runtime.chunk import Chunk, ChunkState
from hf_elixir.runtime.host_update import HostUpdates
from hf_elixir.runtime.ledger import MemoryLedger
from hf_elixir.runtime.timing import StepClock
from hf_elixir.vocab import HfElixirError


class RCacheTooSmall(HfElixirError, RuntimeError):
    pass


class Fetcher:
    def __init__(
        self,
        chunks: Sequence[Chunk],
        cache: RCache,
        ledger: MemoryLedger,
        prefetch_depth: int,
        placeholder: torch.Tensor,
        clock: StepClock,
        host_updates: HostUpdates,
    ) -> None:
        self.chunks = chunks
        #: a chunk still updating on the host thread is waited for before its first use
        self.host_updates = host_updates
        #: charged with the time a fetch waits for gathers (none is marked on a cache hit)
        self.clock = clock
        self.cache = cache
        self.ledger = ledger
        self.prefetch_depth = prefetch_depth
        self.placeholder = placeholder
        self.held: list[int] = []  # chunks pinned for reads outside the modules (hooks.py)
        #: whether any chunk is gathered by a collective or a copy: with every chunk in place
        #: (one rank, shards on the device) there is never anything to prefetch, and looking
        #: ahead in the trace after every fetch was most of the hooks' cost
        self.prefetches = any(not c.in_place for c in chunks)
        self._warned_over = False

    # ------------------------------------------------------------------ public
    def fetch(self, cids: Sequence[int]) -> None:
        """Make the chunks gathered and pin them (the caller unpins after use). On error
        nothing stays pinned."""
        pinned: list[int] = []
        try:
            self._fetch(cids, pinned)
        except BaseException:
            self.unpin(pinned)
            raise
        self.prefetch()

    def _fetch(self, cids: Sequence[int], pinned: list[int]) -> None:
        start = None  # marked at the first chunk this fetch must wait for
        for cid in cids:
            self.host_updates.wait(cid)
            self.cache.note_request(cid)
            chunk = self.chunks[cid]
            if chunk.state is not ChunkState.GATHERED and start is None:
                start = self.clock.mark()
            if chunk.state is ChunkState.RELEASED:
                if not chunk.has_block and not chunk.in_place:  # in place: no block needed
                    self._make_room(exclude=cids)
                    self._take_block(chunk)
                self._gather(chunk, async_op=False)
            else:
                self.cache.stats.hits += 1
            if chunk.state is ChunkState.GATHERING:
                chunk.finish_gather()
            chunk.pins += 1
            pinned.append(cid)
        if start is not None:
            self.clock.device_phase("exposed_communication", start)

    def unpin(self, cids: Sequence[int]) -> None:
        for cid in cids:
            chunk = self.chunks[cid]
            assert chunk.pins > 0, f"chunk {cid} unpinned more often than pinned"
            chunk.pins -= 1

    def release_all(self, keep: Collection[int] = ()) -> None:
        """Mark every gathered chunk stale (before the shards change: an optimizer step, a
        load). Their blocks stay allocated for the next gathers. Waits for every copy that
        reads host shards, so the host may overwrite them when this returns.

        Chunks in ``keep`` stay as they are, gathered or in flight: a frozen chunk, which
        an optimizer step cannot change, or one gathered in place, whose parameters are
        views of the very shard the step updates (``ElixirOptimizer.stays_gathered``)."""
        for chunk in self.chunks:
            if chunk.index in keep:
                if chunk.state is ChunkState.GATHERED:
                    chunk.pins = 0
                continue
            if chunk.state is ChunkState.GATHERING:
                chunk.finish_gather()
            if chunk.state is ChunkState.GATHERED:
                chunk.pins = 0
                chunk.release(self.placeholder)
            chunk.fence_host()

    def free_all(self) -> None:
        """Release every chunk and give every rCache block back."""
        self.release_all()
        for chunk in self.chunks:
            if chunk.has_block:
                self._evict(chunk.index)

    # ------------------------------------------------------------------ internals
    def _take_block(self, chunk: Chunk) -> None:
        chunk.take_block()
        self.cache.admit(chunk.index)
        self.ledger.add("rcache", chunk.full_bytes)
        if len(self.cache.resident) > self.cache.capacity and not self._warned_over:
            self._warned_over = True
            warnings.warn(
                f"hf_elixir: the rCache holds {len(self.cache.resident)} gathered chunks, more than "
                f"the plan's {self.cache.capacity}, because chunks {sorted(set(self.held))} are held "
                "for reads outside their modules (a loss reading a weight directly, "
                "gathered_parameters()) until the backward ends. Memory use is above the plan's "
                f"prediction by up to {len(set(self.held))} block(s); a plan with that many more "
                "rcache_blocks stays within it", RuntimeWarning, stacklevel=2)

    def _gather(self, chunk: Chunk, async_op: bool) -> None:
        self.cache.stats.gathers += 1
        chunk.start_gather(async_op=async_op)

    def _evict(self, cid: int) -> None:
        chunk = self.chunks[cid]
        if chunk.state is ChunkState.GATHERED:
            chunk.release(self.placeholder)
        chunk.free_block()
        self.ledger.sub("rcache", chunk.full_bytes)
        self.cache.evict(cid)

    def _evictable(self, exclude: Sequence[int] = ()) -> list[int]:
        """Resident chunks not in use; stale blocks (nothing to lose) come first."""
        ready = [
            cid
            for cid in self.cache.resident
            if self.chunks[cid].pins == 0
            and self.chunks[cid].state is not ChunkState.GATHERING
            and cid not in exclude
        ]
        stale = [cid for cid in ready if self.chunks[cid].state is ChunkState.RELEASED]
        return stale or ready

    def _make_room(self, exclude: Sequence[int]) -> None:
        # A chunk held for a read outside the modules may stay pinned until the backward
        # ends, longer than the plan's trace knows: each one may take a block beyond the
        # plan's capacity (with a warning) rather than stop the step.
        capacity = self.cache.capacity + len(set(self.held))
        while len(self.cache.resident) >= capacity:
            victim = self.cache.choose_victim(self._evictable(exclude))
            if victim is None:
                in_flight = [c for c in self.cache.resident if self.chunks[c].state is ChunkState.GATHERING]
                if in_flight:  # a prefetch holds the block: finish it, then it is evictable
                    for cid in in_flight:
                        self.chunks[cid].finish_gather()
                    continue
                pinned = sorted(self.cache.resident)
                raise RCacheTooSmall(
                    f"the rCache has {self.cache.capacity} blocks and all hold chunks in use "
                    f"({pinned}) while chunks {list(exclude)} are needed; make a plan with more "
                    "rcache_blocks (or a larger chunk_size, so one module spans fewer chunks)"
                )
            self._evict(victim)

    def prefetch(self) -> None:
        """Start async gathers for the next chunks of the trace, evicting only chunks whose
        next use comes later than the prefetched one's."""
        if not self.prefetches:
            return
        # an in-place chunk costs nothing to "gather" now: no block, no copy; one whose host
        # update the main thread has not waited for yet is gathered when first used
        awaiting = self.host_updates.awaiting
        ready = lambda cid: (self.chunks[cid].state is not ChunkState.RELEASED or self.chunks[cid].in_place  # noqa: E731
                             or cid in awaiting)
        for cid, pos in self.cache.upcoming(self.prefetch_depth, ready):
            chunk = self.chunks[cid]
            if not chunk.has_block:
                if self.cache.full:
                    victim = self.cache.choose_victim(self._evictable(), needed_at=pos)
                    if victim is None:
                        return
                    self._evict(victim)
                self._take_block(chunk)
            self.cache.stats.prefetches += 1
            self._gather(chunk, async_op=True)
