"""Chunk: a flat buffer of parameters, sharded over ranks, gathered on demand.

Every chunk owns one full-size buffer (``full``) whose *storage* is allocated while the
chunk is gathered and resized to zero bytes when it is released. Keeping one storage
object per chunk, instead of handing out blocks from a shared pool, matters for
correctness: autograd saves views of parameters in forward (``weight.t()`` in a linear
layer) and reads them in backward. Those views point at the chunk's storage; because the
chunk is re-gathered into the same storage before its backward, the saved views see the
right values. A shared pool would hand that storage to another chunk in between. The
rCache bounds how many chunks are gathered at once, so the device still holds at most
``rcache_blocks`` gathered chunks (see cache.py).

At world size 1 a chunk whose shard lives on the compute device is gathered *in place*:
``full`` is the shard itself, so there is no second copy of the parameters, no block to
allocate and nothing to copy when it is "gathered".

On a CUDA device, host<->device traffic never blocks the host per chunk. Host shards
(offloaded parameters) are uploaded on a copy stream that overlaps compute; shards the
optimizer updates in host memory are cast to the compute dtype into a pinned staging
buffer and uploaded the same way. CUDA events fence every asynchronous copy: the device
waits for an upload before it reads the uploaded shard, and the host waits for a copy
that reads (or writes) host memory before it overwrites (or reads) that memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from hf_elixir.runtime.comm import Collectives, Work
from hf_elixir.runtime.released import mark_gathered, mark_released


class ChunkState(enum.Enum):
    RELEASED = "released"    # parameters are empty; ``full`` may still hold a (stale) block
    GATHERING = "gathering"  # an async all-gather into ``full`` is in flight
    GATHERED = "gathered"    # ``full`` holds every rank's shard; parameters view into it


@dataclass
class Slot:
    """One parameter's place in a chunk."""

    name: str
    param: nn.Parameter
    index: int           # global slot index (position in the plan's parameter order)
    offset: int          # first element inside the chunk
    numel: int           # elements it takes in the chunk (for a packed weight: its bytes in them)
    shape: torch.Size
    orig_dtype: torch.dtype
    #: a packed 4-bit weight (``profile.params.is_packed``): its bytes lie in the chunk as
    #: they are, seen through ``view`` in ``orig_dtype``, never cast; ``stand_in`` is the
    #: one element its released stand-in points at, so it keeps its own dtype released
    packed: bool = False
    stand_in: Optional[torch.Tensor] = field(default=None, repr=False)

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The parameter as it lies in ``buffer`` (a chunk's gathered values, or a flat
        chunk-sized tensor): its elements at its shape, or for a packed weight its bytes
        read back in its own dtype (offsets are 16-byte aligned, so any dtype can view
        them)."""
        flat = buffer[self.offset : self.offset + self.numel]
        if not self.packed:
            return flat.view(self.shape)
        nbytes = self.shape.numel() * self.orig_dtype.itemsize
        return flat.view(torch.uint8)[:nbytes].view(self.orig_dtype).view(self.shape)

    def local_range(self, shard_begin: int, shard_end: int) -> Optional[tuple[int, int, int]]:
        """(begin, end) inside the rank's shard and the start inside the flat parameter,
        or None when the parameter has no elements in this rank's shard."""
        begin = max(self.offset, shard_begin)
        end = min(self.offset + self.numel, shard_end)
        if begin >= end:
            return None
        return begin - shard_begin, end - shard_begin, begin - self.offset


@dataclass(eq=False)  # identity, not field-by-field tensor comparison
class Chunk:
    index: int
    size: int                      # elements: the contents rounded up to a multiple of W
    dtype: torch.dtype
    device: torch.device           # compute device (where ``full`` lives)
    param_device: torch.device     # where the compute-dtype shard lives
    optim_device: torch.device     # where master, gradient shard and optimizer state live
    comm: Collectives
    slots: list[Slot]
    shard: torch.Tensor = field(repr=False, default=None)        # compute dtype
    master: torch.Tensor = field(repr=False, default=None)       # fp32, may alias ``shard``
    grad_shard: torch.Tensor = field(repr=False, default=None)   # fp32
    full: torch.Tensor = field(repr=False, default=None)         # compute dtype, storage resized
    state: ChunkState = ChunkState.RELEASED
    has_block: bool = False        # ``full`` has its storage (an rCache block) allocated
    pins: int = 0
    work: Work = field(default_factory=Work, repr=False)
    # per-backward gradient collection
    grad_buffer: Optional[torch.Tensor] = field(default=None, repr=False)
    grads_received: set = field(default_factory=set, repr=False)
    reduced: bool = False
    # CUDA only (None on CPU): the side streams for uploads and for gradient downloads, the
    # pinned compute-dtype buffer through which a host-updated shard goes up and its reduced
    # gradient comes down, and the events of the latest upload (device shard or block
    # written) and host read
    copy_stream: Optional[torch.cuda.Stream] = field(default=None, repr=False)
    download_stream: Optional[torch.cuda.Stream] = field(default=None, repr=False)
    staging: Optional[torch.Tensor] = field(default=None, repr=False)
    upload_event: Optional[torch.cuda.Event] = field(default=None, repr=False)
    host_read_event: Optional[torch.cuda.Event] = field(default=None, repr=False)
    _upload_tmp: Optional[torch.Tensor] = field(default=None, repr=False)
    # a staged chunk's ``zero_grad`` only notes that its gradient shard is zero: the next
    # download is copied in rather than added, and the pass that zeroes the shard is saved
    # (``settle_grad`` clears it for any other reader first)
    grad_zeroed: bool = False
    # a host chunk's gradient clipping factor, not yet multiplied in: the gradient is the
    # shard times it. Its update reads it as it reads the shard (the one-pass loop), which
    # saves the clipping a pass over the shard on the main thread; ``settle_grad`` multiplies
    # it in for any other reader, and clearing the gradient drops it
    grad_factor: Optional[torch.Tensor] = field(default=None, repr=False)
    # a frozen chunk holds parameters that need no gradient: its shard is all it has (the
    # master aliases it, the gradient shard is empty, it is never reduced or updated)
    frozen: bool = False
    # on the disk tier (runtime/disk_tier.py): ``master`` (unless it is the shard) and the
    # optimizer state live in files; in memory they are meta stand-ins
    disk: bool = False

    @property
    def shard_size(self) -> int:
        return self.size // self.comm.world_size

    @property
    def shard_begin(self) -> int:
        return self.comm.rank * self.shard_size

    @property
    def full_bytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def packed(self) -> bool:
        """Holds packed 4-bit weights (``Slot.packed``): its values are bytes, never cast."""
        return any(slot.packed for slot in self.slots)

    @property
    def master_aliased(self) -> bool:
        return self.master is self.shard

    @property
    def in_place(self) -> bool:
        """Gathered in place: ``full`` is the shard (world size 1, shard on the device)."""
        return self.full is self.shard

    @property
    def uploads_from_staging(self) -> bool:
        """The optimizer updates this shard in host memory and it lives on the device: each
        update goes up through the staging buffer on the copy stream (CUDA only)."""
        return self.staging is not None and self.copy_stream is not None and self.shard.device == self.device

    @property
    def direct_grads(self) -> bool:
        """Gradients can be added straight into ``grad_shard``: one rank (nothing to
        reduce) and the gradient shard on the compute device."""
        return not self.comm.distributed and self.grad_shard.device == self.device

    def local_slices(self):
        """Yield (slot, shard_begin, shard_end, param_begin) for parameters in this shard."""
        for slot in self.slots:
            rng = slot.local_range(self.shard_begin, self.shard_begin + self.shard_size)
            if rng is not None:
                yield slot, rng[0], rng[1], rng[2]

    # ------------------------------------------------------------------ gather / release
    def take_block(self) -> None:
        assert not self.has_block and not self.in_place
        self.full.untyped_storage().resize_(self.full_bytes)
        self.has_block = True

    def free_block(self) -> None:
        assert self.state is ChunkState.RELEASED and self.has_block
        self.full.untyped_storage().resize_(0)
        self.has_block = False

    def start_gather(self, async_op: bool) -> None:
        assert self.state is ChunkState.RELEASED and (self.has_block or self.in_place)
        if self.in_place:  # nothing to move; only a pending upload to wait for
            self.wait_upload()
            self.work = Work()
        elif self.shard.device != self.device and self.copy_stream is not None:
            self.work = self._gather_from_host()
        else:
            self.wait_upload()
            self.work = self.comm.all_gather(self.full, self.shard, async_op=async_op)
        self.state = ChunkState.GATHERING

    def _gather_from_host(self) -> Work:
        """Offloaded parameters on CUDA: upload the pinned host shard on the copy stream and
        gather from there. The compute stream waits only when the chunk is needed
        (``finish_gather``), so the upload overlaps the compute queued in between."""
        current = torch.cuda.current_stream(self.device)
        stream = self.copy_stream
        stream.wait_stream(current)  # the stale block may still be read by queued kernels
        self.comm.counter.add("host_to_device", self.shard_size * self.dtype.itemsize)
        with torch.cuda.stream(stream):
            if self.comm.distributed:
                self._upload_tmp = torch.empty(self.shard_size, dtype=self.dtype, device=self.device)
                self._upload_tmp.copy_(self.shard, non_blocking=True)
                self.host_read_event = _record(stream)
                # issued under the copy stream: NCCL waits for the upload, not for compute.
                # Always asynchronous: a synchronous call would make the copy stream wait,
                # while finish_gather must make the compute stream wait
                return self.comm.all_gather(self.full, self._upload_tmp, async_op=True)
            self.full.copy_(self.shard, non_blocking=True)
            self.host_read_event = _record(stream)
        return Work(_StreamWait(self.host_read_event, self.device))

    def finish_gather(self) -> None:
        assert self.state is ChunkState.GATHERING
        self.work.wait()
        self._upload_tmp = None  # the compute stream now waits for the gather that read it
        for slot in self.slots:
            mark_gathered(slot.param, slot.view(self.full))
        self.state = ChunkState.GATHERED

    # ------------------------------------------------------------------ host <-> device fences
    def wait_upload(self) -> None:
        """Make the current stream wait for the latest upload into the device shard."""
        if self.upload_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.upload_event)

    def fence_host(self) -> None:
        """Block the host until no asynchronous copy reads or writes this chunk's host
        memory (the host shard, the staging buffer); call before the host writes it."""
        for event in (self.host_read_event, self.upload_event):
            if event is not None:
                event.synchronize()

    def upload_from_staging(self, readers_done: torch.cuda.Event, count: bool = True) -> None:
        """Copy the staging buffer (the updated shard, cast on the host) into the device
        shard on the copy stream, once ``readers_done`` (recorded on the compute stream
        after the last gather that read the old shard) has passed. Gathers wait for the
        upload on the device (``wait_upload``), the host before it rewrites the staging
        buffer (``fence_host``). ``count=False``: the caller counted the bytes already (an
        upload issued on the host update thread is counted when the step queues it, so that
        a step's count is in that step's window and never raced)."""
        stream = self.copy_stream
        stream.wait_event(readers_done)
        if count:
            self.comm.counter.add("host_to_device", self.upload_bytes)
        with torch.cuda.stream(stream):
            self.shard.copy_(self.staging, non_blocking=True)
            self.upload_event = _record(stream)

    @property
    def upload_bytes(self) -> int:
        """Bytes one upload from the staging buffer moves."""
        return self.staging.numel() * self.staging.element_size()

    def release(self, placeholder: torch.Tensor) -> None:
        """Parameters become unreadable stand-ins (``released.py``) until the next gather. The
        block stays allocated (re-gathering into it costs no allocation) until the rCache
        evicts it."""
        assert self.state is ChunkState.GATHERED and self.pins == 0
        for slot in self.slots:
            mark_released(slot.param, placeholder if slot.stand_in is None else slot.stand_in)
        self.state = ChunkState.RELEASED

    # ------------------------------------------------------------------ gradients
    def settle_grad(self, keep_factor: bool = False) -> None:
        """Make the gradient shard hold what it means: zeros after a ``zero_grad`` whose
        clearing was left to the next download (``grad_zeroed``), the clipped gradient where
        the clipping factor is pending (``grad_factor``; ``keep_factor``: the caller is the
        update, which takes the factor itself). Every reader and writer of the shard but that
        download calls this first."""
        if self.grad_zeroed:
            self.grad_shard.zero_()
            self.grad_zeroed = False
            self.grad_factor = None
        if self.grad_factor is not None and not keep_factor:
            self.grad_shard.mul_(self.grad_factor)
            self.grad_factor = None

    def receive_grad(self, slot: Slot, grad: torch.Tensor) -> None:
        """Copy one parameter's full gradient into the chunk's gradient buffer."""
        view = self.grad_buffer[slot.offset : slot.offset + slot.numel]
        if slot.index in self.grads_received:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self.grads_received.add(slot.index)

    def zero_missing_grads(self) -> None:
        """The buffer starts uninitialised (zeroing all of it would cost a full pass):
        zero what no gradient was written to, the alignment gaps and the tail included."""
        end = 0
        for slot in self.slots:  # in offset order
            if slot.offset > end:
                self.grad_buffer[end : slot.offset].zero_()
            if slot.index not in self.grads_received:
                self.grad_buffer[slot.offset : slot.offset + slot.numel].zero_()
            end = slot.offset + slot.numel
        self.grad_buffer[end:].zero_()

    @property
    def grads_complete(self) -> bool:
        return len(self.grads_received) == len(self.slots)


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class _StreamWait:
    """A Work handle whose wait makes the current stream wait for an event (no host sync)."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)
