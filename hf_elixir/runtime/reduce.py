"""Gradient hand-off: full-chunk gradients are reduce-scattered into fp32 gradient shards.

Chunks are reduce-scattered strictly in descending index order, every chunk once per
backward. A chunk goes as soon as all its parameters have their gradient and every
higher chunk has gone; what is left at the end of backward (parameters that got no
gradient on this rank, e.g. experts nobody routed to) goes then, with zeros. Because the
sequence of chunks is the same on every rank, the collectives line up even when ranks
run different experts; only the timing differs.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import torch

from hf_elixir.runtime.chunk import Chunk, Slot
from hf_elixir.runtime.comm import Collectives, Work
from hf_elixir.runtime.ledger import MemoryLedger


class GradReducer:
    def __init__(
        self,
        chunks: Sequence[Chunk],
        comm: Collectives,
        ledger: MemoryLedger,
        n_slots: int,
        max_in_flight: int = 2,
    ) -> None:
        self.chunks = chunks
        self.comm = comm
        self.ledger = ledger
        self.max_in_flight = max_in_flight
        self.next = len(chunks) - 1          # the next chunk to reduce-scatter
        self.late: set[int] = set()          # chunks that received gradients after going
        self.pending: deque[tuple[Chunk, Optional[torch.Tensor], Work]] = deque()
        # which parameters received a gradient since the last optimizer step, on this rank
        self.seen = torch.zeros(n_slots, dtype=torch.uint8)
        self.enabled = True

    # ------------------------------------------------------------------ during backward
    def on_grad(self, chunk: Chunk, slot: Slot, grad: torch.Tensor) -> None:
        if chunk.reduced:  # a second gradient for a chunk that already went (rare)
            self.late.add(chunk.index)
            while self.pending:  # its buffer may still be in flight: finish before reuse
                self._complete(self.pending.popleft())
            if chunk.grad_buffer is None:  # a fresh buffer holds only the late gradients
                chunk.grads_received.clear()
        if chunk.grad_buffer is None and self._can_adopt(chunk, grad):
            # a chunk that is exactly one parameter (a large embedding) adopts autograd's
            # gradient tensor as its buffer instead of copying it
            chunk.grad_buffer = grad.view(-1)
            chunk.grads_received.add(slot.index)
            self.ledger.add("grad_buffers", chunk.full_bytes)
        else:
            if chunk.grad_buffer is None:
                chunk.grad_buffer = torch.empty(chunk.size, dtype=chunk.dtype, device=chunk.device)
                self.ledger.add("grad_buffers", chunk.full_bytes)
            chunk.receive_grad(slot, grad)
        self.seen[slot.index] = 1
        self._flush_ready()

    @staticmethod
    def _can_adopt(chunk: Chunk, grad: torch.Tensor) -> bool:
        return (
            len(chunk.slots) == 1
            and chunk.slots[0].numel == chunk.size
            and grad.is_contiguous()
            and grad.dtype == chunk.dtype
            and grad.device == chunk.device
        )

    def _flush_ready(self) -> None:
        while self.next >= 0 and self.chunks[self.next].grads_complete:
            self._reduce(self.chunks[self.next])
            self.next -= 1

    def _reduce(self, chunk: Chunk) -> None:
        if chunk.grad_buffer is None:  # nothing arrived on this rank: contribute zeros
            chunk.grad_buffer = torch.empty(chunk.size, dtype=chunk.dtype, device=chunk.device)
            self.ledger.add("grad_buffers", chunk.full_bytes)
        chunk.zero_missing_grads()
        scratch = None
        if self.comm.reduce_needs_scratch:
            scratch = torch.empty(chunk.shard_size, dtype=chunk.dtype, device=chunk.device)
            self.ledger.add("grad_buffers", scratch.numel() * scratch.element_size())
        work = self.comm.reduce_scatter_accumulate(chunk.grad_shard, chunk.grad_buffer, scratch, async_op=True)
        self.pending.append((chunk, scratch, work))
        chunk.reduced = True
        while len(self.pending) > self.max_in_flight:
            self._complete(self.pending.popleft())

    def _complete(self, entry: tuple[Chunk, Optional[torch.Tensor], Work]) -> None:
        chunk, scratch, work = entry
        work.wait()  # also adds the reduced slice into chunk.grad_shard
        if scratch is not None:
            self.ledger.sub("grad_buffers", scratch.numel() * scratch.element_size())
        if chunk.grad_buffer is not None:
            chunk.grad_buffer = None
            self.ledger.sub("grad_buffers", chunk.full_bytes)

    # ------------------------------------------------------------------ end of backward
    def end_backward(self) -> None:
        """Reduce what is left, wait for every reduce-scatter, reset for the next backward."""
        while self.next >= 0:
            self._reduce(self.chunks[self.next])
            self.next -= 1
        for cid in sorted(self.late, reverse=True):
            self._reduce(self.chunks[cid])
        while self.pending:
            self._complete(self.pending.popleft())
        for chunk in self.chunks:
            chunk.grads_received.clear()
            chunk.reduced = False
        self.late.clear()
        self.next = len(self.chunks) - 1

    def abandon(self) -> None:
        """After a failed backward: finish what is in flight, drop buffers, reset."""
        while self.pending:
            self._complete(self.pending.popleft())
        for chunk in self.chunks:
            if chunk.grad_buffer is not None:
                chunk.grad_buffer = None
                self.ledger.sub("grad_buffers", chunk.full_bytes)
            chunk.grads_received.clear()
            chunk.reduced = False
        self.late.clear()
        self.next = len(self.chunks) - 1

    def global_seen(self) -> torch.Tensor:
        """Per parameter: did any rank receive a gradient since the last step? (one all-reduce)"""
        return self.comm.all_reduce(self.seen.clone(), op="max").bool()

    def clear_seen(self) -> None:
        self.seen.zero_()
