"""Gradient hand-off: full-chunk gradients are reduce-scattered into fp32 gradient shards.

Trainable chunks are reduce-scattered strictly in descending index order, every chunk once
per backward (frozen chunks have no gradient and take no part). A chunk goes as soon as all its parameters have their gradient and every
higher chunk has gone; what is left at the end of backward (parameters that got no
gradient on this rank, e.g. experts nobody routed to) goes then, with zeros. Because the
sequence of chunks is the same on every rank, the collectives line up even when ranks
run different experts; only the timing differs.

A chunk that receives a gradient after it went (a *late* chunk) is reduce-scattered once
more at the end of backward. Whether that happens depends on this rank's graph, so the
ranks first agree on the set of late chunks (one small all-reduce per backward): a rank
that issued the extra collective alone would hang NCCL.

A chunk on the disk tier has no gradient shard in memory: its reduction adds into a buffer
of the tier's gradient ring (``disk_grads.py``), written back to the file once added.

At world size 1 with the gradient shard on the compute device there is nothing to reduce:
gradients are added straight into the fp32 shard. Where the parameter is fp32 too, its
``.grad`` *is* its place in the shard (``use_grad_views``): autograd adds into it, as into
any gradient a parameter already has, and nothing is copied; in a resident runtime no hook
sees it arrive, and ``collect_views`` notes it by its version counter. With the optimizer
state in host memory
behind a CUDA device, each reduced shard goes down asynchronously (compute dtype) into
the chunk's pinned staging buffer, and the host waits once, at the end of backward,
before adding them into the fp32 gradient shards.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import torch

from hf_elixir.planner.cost import REDUCTIONS_IN_FLIGHT
from hf_elixir.planner.packing import adopts_gradient
from hf_elixir.runtime.chunk import Chunk, Slot
from hf_elixir.runtime.comm import Collectives, Work
from hf_elixir.runtime.disk_tier import DiskTier
from hf_elixir.runtime.host_update import HostUpdates
from hf_elixir.runtime.ledger import MemoryLedger
from hf_elixir.runtime.schedule import END_BACKWARD
from hf_elixir.runtime.timing import StepClock
from hf_elixir.runtime.widen import add_widened

#: what the last element of the end-of-backward all-reduce says (the maximum over ranks wins)
HEALTHY, REPLAN, FAILED = 0, 1, 2


class GradReducer:
    def __init__(
        self,
        chunks: Sequence[Chunk],
        comm: Collectives,
        ledger: MemoryLedger,
        n_slots: int,
        *,
        clock: StepClock,
        host_updates: HostUpdates,
        max_in_flight: int = REDUCTIONS_IN_FLIGHT,
        disk: Optional[DiskTier] = None,
    ) -> None:
        self.chunks = chunks
        #: the gradient planes of chunks on the disk tier
        self.disk_grads = disk.grads if disk is not None else None
        #: a gradient for a chunk still updating on the host thread waits for that update
        self.host_updates = host_updates
        #: charged with the waits for reductions and downloads, told where each backward ends
        self.clock = clock
        self.trainable = [c for c in chunks if not c.frozen]
        self.comm = comm
        self.ledger = ledger
        self.max_in_flight = max_in_flight
        self.next = len(self.trainable) - 1  # position in ``trainable`` of the next to reduce
        self.late: set[int] = set()          # chunks that received gradients after going
        self.pending: deque[tuple[Chunk, Optional[torch.Tensor], Work]] = deque()
        self.downloads: list[Chunk] = []     # staged chunks whose download is in flight
        # which parameters received a gradient since the last optimizer step, on this rank
        # kept in a bytearray the tensor shares: setting one byte of it per gradient costs
        # nothing, where indexing a tensor from Python costs microseconds per parameter
        self._seen = bytearray(max(n_slots, 1))
        self.seen = torch.frombuffer(self._seen, dtype=torch.uint8)[:n_slots]
        self.enabled = True
        #: what this rank reports at the end of the next backward (REPLAN: an optimizer step
        #: had to recover locally and asks every rank to re-plan)
        self.report = HEALTHY
        #: what the ranks agreed at the end of the latest backward (the maximum reported)
        self.agreed = HEALTHY
        #: slot index -> that parameter's gradient as it lies in its chunk's gradient shard,
        #: set as the parameter's ``.grad`` (``use_grad_views``)
        self.grad_views: dict[int, torch.Tensor] = {}
        self._viewed: set[int] = set()  # id() of those parameters
        #: (slot index, parameter, its gradient in the shard) for each of them
        self._view_params: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        #: no hook sees those gradients arrive (``collect_views`` notes them instead), and
        #: each one's version counter when it was last looked at
        self.collecting = False
        self._versions: dict[int, int] = {}

    def use_grad_views(self, slots: Sequence[Slot], slot_chunk: Sequence[Chunk], exclude: frozenset[int]) -> None:
        """Give every fp32 parameter of a chunk with direct gradients (one rank, gradient
        shard on the compute device), except the chunks in ``exclude``, its place in the
        gradient shard as its ``.grad``. Autograd then adds each gradient into the shard
        itself, where the hook that copies it there cost a deep, narrow model a quarter of
        its backward on a CPU. Excluded: chunks updated on the host thread behind the next
        forward, whose update still reads the gradient shard when the next backward could
        already write it (``on_grad`` waits for that update first)."""
        for slot, chunk in zip(slots, slot_chunk):
            if (chunk.frozen or chunk.disk or slot.packed or chunk.index in exclude or not chunk.direct_grads
                    or slot.param.dtype != chunk.grad_shard.dtype):
                continue
            view = _alias(chunk.grad_shard, slot.offset, slot.shape)
            self.grad_views[slot.index] = view
            self._viewed.add(id(slot.param))
            self._view_params.append((slot.index, slot.param, view))
            slot.param.grad = view

    def collect_views(self) -> None:
        """Note which parameters with a gradient in the shard received one, where no hook
        told (``collecting``: the resident runtime takes those hooks off). Autograd's
        in-place add bumps the version counter of the tensor it adds into, and each
        parameter's place in the shard is a tensor of its own (``_alias``), so a changed
        counter is a gradient. A new tensor in ``.grad`` (the model's own ``zero_grad()``
        then a backward, ``create_graph``) replaces the place's contents as in
        ``grad_in_view``; ``None`` (a ``zero_grad()`` with no backward since) zeroes it.
        Runs at the end of every backward and before the optimizer reads the shards."""
        if not self.collecting:
            return
        versions, seen = self._versions, self._seen
        for index, param, view in self._view_params:
            grad = param.grad
            if grad is not view:
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                    seen[index] = 1
                param.grad = view
            elif view._version != versions.get(index):
                seen[index] = 1
            versions[index] = view._version

    def start_collecting(self, on: bool) -> None:
        """Whether ``collect_views`` notes the gradients (no hook does); counted from now."""
        self.collecting = on
        self._versions = {index: view._version for index, _, view in self._view_params}

    def clear_grads(self, params: Sequence[torch.Tensor], set_to_none: bool) -> None:
        """What ``nn.Module.zero_grad`` does to ``params``, except to a gradient that is a view
        of its shard: that stays the parameter's ``.grad`` (the shard is zeroed instead)."""
        viewed = self._viewed
        for param in params:
            grad = param.grad
            if grad is None or id(param) in viewed:
                continue
            if set_to_none:
                param.grad = None
                continue
            if grad.grad_fn is not None:
                grad.detach_()
            else:
                grad.requires_grad_(False)
            grad.zero_()

    def grad_in_view(self, slot: Slot, grad: Optional[torch.Tensor], view: torch.Tensor) -> None:
        """A parameter whose ``.grad`` is its view (``use_grad_views``) has its gradient. When
        autograd handed a new tensor instead, the parameter's ``.grad`` had been cleared
        (which in PyTorch zeroes it) or the backward builds a graph (``create_graph``,
        where autograd sums out of place): either way that tensor is the whole gradient,
        so it replaces the view's contents and the view becomes ``.grad`` again."""
        self._seen[slot.index] = 1
        if grad is not view:
            if grad is not None:
                view.copy_(grad)
            slot.param.grad = view

    # ------------------------------------------------------------------ during backward
    def _settled(self, chunk: Chunk) -> None:
        """Wait for the chunk's host update if it still runs (it reads the gradient shard);
        a gradient added to one that was clipped (no ``zero_grad`` since the step) is added to
        the clipped values, so a pending clipping factor is multiplied in first."""
        self.host_updates.wait(chunk.index)
        if chunk.grad_factor is not None:
            chunk.settle_grad()

    def on_grad(self, chunk: Chunk, slot: Slot, grad: torch.Tensor) -> None:
        self._settled(chunk)
        self._seen[slot.index] = 1
        if chunk.direct_grads:
            add_widened(chunk.grad_shard[slot.offset : slot.offset + slot.numel], grad.reshape(-1))
            return
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
        self._flush_ready()

    @staticmethod
    def _can_adopt(chunk: Chunk, grad: torch.Tensor) -> bool:
        return (
            adopts_gradient([slot.numel for slot in chunk.slots], chunk.size)
            and grad.is_contiguous()
            and grad.dtype == chunk.dtype
            and grad.device == chunk.device
        )

    def _flush_ready(self) -> None:
        while self.next >= 0 and (self.trainable[self.next].grads_complete or self.trainable[self.next].direct_grads):
            self._reduce(self.trainable[self.next])
            self.next -= 1

    def _reduce(self, chunk: Chunk) -> None:
        self._settled(chunk)  # a chunk no module used this pass was never waited for
        if chunk.direct_grads:  # already in the shard
            chunk.reduced = True
            return
        if chunk.grad_buffer is None:  # nothing arrived on this rank: contribute zeros
            chunk.grad_buffer = torch.empty(chunk.size, dtype=chunk.dtype, device=chunk.device)
            self.ledger.add("grad_buffers", chunk.full_bytes)
        chunk.zero_missing_grads()
        scratch = None
        if self.comm.reduce_needs_scratch:
            scratch = torch.empty(chunk.shard_size, dtype=chunk.dtype, device=chunk.device)
            self.ledger.add("grad_buffers", scratch.numel() * scratch.element_size())
        if chunk.staging is not None:  # reduced on the device, then sent to the host
            work = self.comm.reduce_scatter_mean(scratch, chunk.grad_buffer, async_op=True) \
                if self.comm.distributed else Work()
        else:  # added into the shard when the work completes (a disk chunk's: a ring buffer)
            target = self.disk_grads.open(chunk.index) if chunk.disk else chunk.grad_shard
            work = self.comm.reduce_scatter_accumulate(target, chunk.grad_buffer, scratch, async_op=True)
        self.pending.append((chunk, scratch, work))
        chunk.reduced = True
        while len(self.pending) > self.max_in_flight:
            self._complete(self.pending.popleft())

    def _download(self, chunk: Chunk, reduced: torch.Tensor) -> None:
        """Start the device-to-host copy of a reduced shard into the pinned staging buffer, on
        the download stream: the rest of backward's kernels do not queue behind it, as the
        cost model assumes (its downloads overlap backward)."""
        if chunk in self.downloads:  # its last download is not added in yet (a late chunk)
            self._drain_downloads()
        stream = chunk.download_stream
        stream.wait_stream(torch.cuda.current_stream(chunk.device))  # queued kernels write ``reduced``
        if chunk.upload_event is not None:  # the staging buffer may still be feeding the last upload
            stream.wait_event(chunk.upload_event)
        self.comm.counter.add("device_to_host", reduced.numel() * reduced.element_size())
        with torch.cuda.stream(stream):
            chunk.staging.copy_(reduced, non_blocking=True)
        if reduced.is_cuda:  # its memory goes back to the allocator: not reused before the copy read it
            reduced.record_stream(stream)
        self.downloads.append(chunk)

    def _drain_downloads(self) -> None:
        """Wait once for every download, then add them into the fp32 gradient shards."""
        if not self.downloads:
            return
        clock = self.clock
        start = clock.now()
        self.downloads[0].download_stream.synchronize()  # one stream for every chunk of the module
        clock.host_phase("pcie", start)
        start = clock.now()
        for chunk in self.downloads:
            if chunk.disk:
                with self.disk_grads.opened(chunk.index) as grad:
                    add_widened(grad, chunk.staging)
            elif chunk.grad_zeroed:  # zero_grad left the clearing to this copy (clear_grad)
                chunk.grad_shard.copy_(chunk.staging)
                chunk.grad_zeroed = False
            else:
                add_widened(chunk.grad_shard, chunk.staging)
        self.downloads.clear()
        clock.host_phase("host_copies", start)

    def _complete(self, entry: tuple[Chunk, Optional[torch.Tensor], Work]) -> None:
        chunk, scratch, work = entry
        start = self.clock.mark()
        work.wait()  # also adds the reduced slice into chunk.grad_shard (unless staged)
        self.clock.device_phase("exposed_communication", start)
        if chunk.disk and chunk.staging is None:  # the sum is in the ring buffer: write it back
            self.disk_grads.close(chunk.index)
        if chunk.staging is not None:  # one rank: the buffer's first shard_size elements are the shard
            self._download(chunk, scratch if scratch is not None else chunk.grad_buffer[: chunk.shard_size])
        if scratch is not None:
            self.ledger.sub("grad_buffers", scratch.numel() * scratch.element_size())
        if chunk.grad_buffer is not None:
            chunk.grad_buffer = None
            self.ledger.sub("grad_buffers", chunk.full_bytes)

    # ------------------------------------------------------------------ end of backward
    def end_backward(self) -> None:
        """Reduce what is left, wait for every reduce-scatter, reset for the next backward."""
        while self.next >= 0:
            self._reduce(self.trainable[self.next])
            self.next -= 1
        late = self.agreed_late()
        if self.agreed == FAILED:  # a rank failed this pass: its gradients are dropped anyway
            late = []
        for cid in late:
            chunk = self.chunks[cid]
            if cid not in self.late:  # late elsewhere only: this rank contributes zeros
                chunk.grads_received.clear()
            self._reduce(chunk)
        while self.pending:
            self._complete(self.pending.popleft())
        self.clock.end_pass()  # the pass ends here; the host's wait for downloads is pcie
        self._drain_downloads()
        for chunk in self.chunks:
            chunk.grads_received.clear()
            chunk.reduced = False
        self.late.clear()
        self.next = len(self.trainable) - 1
        self.comm.counter.backward_passes += 1

    def agreed_late(self) -> list[int]:
        """The chunks late on any rank, in descending order (every rank gets the same list).
        Direct-gradient chunks are never late (they have nothing to reduce).

        The same all-reduce carries, in its last element, the worst of the ranks' reports
        (``agreed``): a rank that failed this pass and finished it hollowly reports FAILED
        (schedule.py), so every rank learns of it here, at no extra collective."""
        report, self.report = self.report, HEALTHY
        if not self.comm.distributed:
            self.agreed = report
            return sorted(self.late, reverse=True)
        flags = torch.zeros(len(self.chunks) + 1, dtype=torch.uint8)
        for cid in self.late:
            flags[cid] = 1
        flags[-1] = report
        self.comm.all_reduce(flags, op="max", tag=END_BACKWARD)
        self.agreed = int(flags[-1])
        return flags[:-1].nonzero().flatten().flip(0).tolist()

    def abandon(self) -> None:
        """After a failed backward: finish what is in flight, drop buffers, reset."""
        while self.pending:
            self._complete(self.pending.popleft())
        self._drain_downloads()
        for chunk in self.chunks:
            if chunk.grad_buffer is not None:
                chunk.grad_buffer = None
                self.ledger.sub("grad_buffers", chunk.full_bytes)
            chunk.grads_received.clear()
            chunk.reduced = False
        self.late.clear()
        self.next = len(self.trainable) - 1

    def global_seen(self, failed: bool = False) -> tuple[torch.Tensor, bool]:
        """Per parameter: did any rank receive a gradient since the last step? And did any
        rank fail since then (``failed`` is this rank's answer)? One all-reduce."""
        flags = torch.cat([self.seen, torch.tensor([int(failed)], dtype=torch.uint8)])
        flags = self.comm.all_reduce(flags, op="max")
        return flags[:-1].bool(), bool(flags[-1])

    def clear_seen(self) -> None:
        self.seen.zero_()


def _alias(flat: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """``flat[offset:offset + n]`` at ``shape``, as a tensor of its own over the same memory,
    not a view: a view shares its base's version counter, this has its own, so autograd
    adding a gradient into it marks this parameter alone (``collect_views``)."""
    alias = torch.empty(0, dtype=flat.dtype, device=flat.device)
    return alias.set_(flat.untyped_storage(), flat.storage_offset() + offset, shape,
                      torch.empty(shape, device="meta").stride())
