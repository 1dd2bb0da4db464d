"""Fetching chunks for the module about to run, and prefetching the next ones.

Every rank must issue the same all-gathers in the same order. Requests come from module
hooks, which fire in the same order on every rank (data-dependent modules are fetched as
one unit, see ElixirPlan.fetch_units), and every decision here (hit, eviction, prefetch)
depends only on that request sequence, so the collectives line up.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hf_elixir.runtime.cache import RCache
from hf_elixir.runtime.chunk import Chunk, ChunkState
from hf_elixir.runtime.ledger import MemoryLedger


class RCacheTooSmall(RuntimeError):
    pass


class Fetcher:
    def __init__(
        self,
        chunks: Sequence[Chunk],
        cache: RCache,
        ledger: MemoryLedger,
        prefetch_depth: int,
        placeholder: torch.Tensor,
    ) -> None:
        self.chunks = chunks
        self.cache = cache
        self.ledger = ledger
        self.prefetch_depth = prefetch_depth
        self.placeholder = placeholder

    # ------------------------------------------------------------------ public
    def fetch(self, cids: Sequence[int]) -> None:
        """Make the chunks gathered and pin them (the caller unpins after use)."""
        for cid in cids:
            self.cache.note_request(cid)
            chunk = self.chunks[cid]
            if chunk.state is ChunkState.RELEASED:
                self._make_room(exclude=cids)
                self._gather(chunk, async_op=False)
            else:
                self.cache.stats.hits += 1
            if chunk.state is ChunkState.GATHERING:
                chunk.finish_gather()
            chunk.pins += 1
        self._prefetch()

    def unpin(self, cids: Sequence[int]) -> None:
        for cid in cids:
            chunk = self.chunks[cid]
            assert chunk.pins > 0, f"chunk {cid} unpinned more often than pinned"
            chunk.pins -= 1

    def release_all(self) -> None:
        """Drop every gathered chunk (their contents are stale after an optimizer step)."""
        for chunk in self.chunks:
            if chunk.state is ChunkState.GATHERING:
                chunk.finish_gather()
            if chunk.state is ChunkState.GATHERED:
                chunk.pins = 0
                self._release(chunk)
                self.cache.drop(chunk.index)

    # ------------------------------------------------------------------ internals
    def _gather(self, chunk: Chunk, async_op: bool) -> None:
        self.cache.admit(chunk.index)
        self.ledger.add("rcache", chunk.full_bytes)
        chunk.start_gather(async_op=async_op)

    def _release(self, chunk: Chunk) -> None:
        chunk.release(self.placeholder)
        self.ledger.sub("rcache", chunk.full_bytes)

    def _evictable(self, exclude: Sequence[int] = ()) -> list[int]:
        return [
            cid
            for cid in self.cache.resident
            if self.chunks[cid].pins == 0
            and self.chunks[cid].state is ChunkState.GATHERED
            and cid not in exclude
        ]

    def _make_room(self, exclude: Sequence[int]) -> None:
        while self.cache.full:
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
            self._release(self.chunks[victim])
            self.cache.evict(victim)

    def _prefetch(self) -> None:
        for cid, pos in self.cache.upcoming(self.prefetch_depth):
            chunk = self.chunks[cid]
            if chunk.state is not ChunkState.RELEASED:
                continue
            if self.cache.full:
                victim = self.cache.choose_victim(self._evictable(), needed_at=pos)
                if victim is None:
                    return
                self._release(self.chunks[victim])
                self.cache.evict(victim)
            self.cache.stats.prefetches += 1
            self._gather(chunk, async_op=True)
