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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from hf_elixir.runtime.comm import Collectives, Work


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
    numel: int
    shape: torch.Size
    orig_dtype: torch.dtype

    def local_range(self, shard_begin: int, shard_end: int) -> Optional[tuple[int, int, int]]:
        """(begin, end) inside the rank's shard and the start inside the flat parameter,
        or None when the parameter has no elements in this rank's shard."""
        begin = max(self.offset, shard_begin)
        end = min(self.offset + self.numel, shard_end)
        if begin >= end:
            return None
        return begin - shard_begin, end - shard_begin, begin - self.offset


@dataclass
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
    def master_aliased(self) -> bool:
        return self.master is self.shard

    def local_slices(self):
        """Yield (slot, shard_begin, shard_end, param_begin) for parameters in this shard."""
        for slot in self.slots:
            rng = slot.local_range(self.shard_begin, self.shard_begin + self.shard_size)
            if rng is not None:
                yield slot, rng[0], rng[1], rng[2]

    # ------------------------------------------------------------------ gather / release
    def take_block(self) -> None:
        assert not self.has_block
        self.full.untyped_storage().resize_(self.full_bytes)
        self.has_block = True

    def free_block(self) -> None:
        assert self.state is ChunkState.RELEASED and self.has_block
        self.full.untyped_storage().resize_(0)
        self.has_block = False

    def start_gather(self, async_op: bool) -> None:
        assert self.state is ChunkState.RELEASED and self.has_block
        shard = self.shard
        if shard.device != self.device:
            shard = shard.to(self.device, non_blocking=True)
        self.work = self.comm.all_gather(self.full, shard, async_op=async_op)
        self.state = ChunkState.GATHERING

    def finish_gather(self) -> None:
        assert self.state is ChunkState.GATHERING
        self.work.wait()
        for slot in self.slots:
            slot.param.data = self.full[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self.state = ChunkState.GATHERED

    def release(self, placeholder: torch.Tensor) -> None:
        """Parameters become empty tensors until the next gather. The block stays allocated
        (re-gathering into it costs no allocation) until the rCache evicts it."""
        assert self.state is ChunkState.GATHERED and self.pins == 0
        for slot in self.slots:
            slot.param.data = placeholder
        self.state = ChunkState.RELEASED

    # ------------------------------------------------------------------ gradients
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
        zero what no gradient was written to, the padding included."""
        end = 0
        for slot in self.slots:
            if slot.index not in self.grads_received:
                self.grad_buffer[slot.offset : slot.offset + slot.numel].zero_()
            end = slot.offset + slot.numel
        self.grad_buffer[end:].zero_()

    @property
    def grads_complete(self) -> bool:
        return len(self.grads_received) == len(self.slots)
