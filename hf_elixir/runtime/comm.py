"""Collectives over a process group, with a single-process fallback.

Two process groups carry the traffic: one for parameter all-gathers and one for gradient
reduce-scatters and the small all-reduces of the optimizer step. Gathers are issued in the
(rank-identical) fetch order and reduce-scatters in the (rank-identical) descending chunk
order, but how the two sequences interleave depends on when each rank's autograd engine
reaches a hook; separate groups make each sequence match on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist


class _WaitAll:
    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


class Work:
    """A handle for a collective that may still be running, with an optional finishing
    step to run once it is done (None: already done)."""

    def __init__(self, handle: Optional[object] = None, then: Optional[Callable[[], object]] = None) -> None:
        self._handle = handle
        self._then = then
        if handle is None and then is not None:  # synchronous: finish now
            self.wait()

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _accumulate(target: torch.Tensor, source: torch.Tensor, scale: float) -> None:
    if source.device != target.device:
        # host-to-device may run async on the stream; device-to-host must be complete
        # before the CPU reads it
        source = source.to(target.device, non_blocking=target.device.type != "cpu")
    target.add_(source, alpha=scale)


@dataclass
class Collectives:
    """The process groups the runtime talks over; world size 1 needs no group at all."""

    rank: int
    world_size: int
    gather_group: Optional[dist.ProcessGroup] = None
    reduce_group: Optional[dist.ProcessGroup] = None
    # gloo's all-gather and reduce-scatter are slow (measured on 20M fp32 elements, 2 ranks:
    # all-gather 0.062 s, reduce-scatter 0.083 s, all-reduce 0.044 s, one broadcast per
    # rank 0.020 s), so on gloo a gather is W broadcasts and a reduce-scatter an
    # all-reduce; NCCL uses the native collectives.
    gloo: bool = False  # the groups run gloo (host tensors; see above)
    global_ranks: tuple[int, ...] = ()

    @classmethod
    def create(cls, process_group: Optional[dist.ProcessGroup] = None) -> "Collectives":
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        if process_group is None:
            return cls(rank=0, world_size=1)
        world_size = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        if world_size == 1:
            return cls(rank=rank, world_size=1, gather_group=process_group, reduce_group=process_group)
        ranks = dist.get_process_group_ranks(process_group)
        reduce_group = dist.new_group(ranks, use_local_synchronization=True)
        gloo = dist.get_backend(process_group) == "gloo"
        return cls(rank=rank, world_size=world_size, gather_group=process_group,
                   reduce_group=reduce_group, gloo=gloo, global_ranks=tuple(ranks))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Work:
        """Fill ``output`` (world_size * shard elements) with every rank's shard, in rank order."""
        if not self.distributed:
            output.copy_(shard)
            return Work()
        if self.gloo:  # gloo: one broadcast from each rank of its own shard
            n = shard.numel()
            output[self.rank * n : (self.rank + 1) * n].copy_(shard)
            handles = [  # every rank joins every broadcast, in the same order
                dist.broadcast(output[r * n : (r + 1) * n], src=self.global_ranks[r],
                               group=self.gather_group, async_op=True)
                for r in range(self.world_size)
            ]
            work = Work(_WaitAll(handles))
            if not async_op:
                work.wait()
            return work
        return Work(dist.all_gather_single(output, shard, group=self.gather_group, async_op=async_op))

    @property
    def reduce_needs_scratch(self) -> bool:
        """Whether reduce_scatter_accumulate needs a shard-sized scratch tensor."""
        return self.distributed and not self.gloo

    def reduce_scatter_accumulate(
        self, target: torch.Tensor, full: torch.Tensor, scratch: Optional[torch.Tensor] = None,
        async_op: bool = False,
    ) -> Work:
        """Add this rank's slice of the mean of ``full`` over ranks into ``target``.

        ``full`` may be overwritten (the all-reduce path reduces it in place); ``scratch``
        (shard-sized, ``full``'s dtype) is needed when reduce_needs_scratch."""
        n = target.numel()
        if not self.distributed:
            return Work(None, then=lambda: _accumulate(target, full[:n], 1.0))
        if self.gloo:
            piece = full[self.rank * n : (self.rank + 1) * n]
            handle = dist.all_reduce(full, group=self.reduce_group, async_op=async_op)
            return Work(handle, then=lambda: _accumulate(target, piece, 1.0 / self.world_size))
        handle = dist.reduce_scatter_single(
            scratch, full, op=dist.ReduceOp.AVG, group=self.reduce_group, async_op=async_op
        )
        return Work(handle, then=lambda: _accumulate(target, scratch, 1.0))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a small tensor (flags, norms), wherever it lives: NCCL
        reduces only device tensors, so host tensors make a round trip."""
        if self.distributed:
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            if self.gloo or tensor.device.type != "cpu":
                dist.all_reduce(tensor, op=red, group=self.reduce_group)
            else:
                on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(on_device, op=red, group=self.reduce_group)
                tensor.copy_(on_device)
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` with the group's first rank's copy (so all ranks start equal)."""
        if self.distributed:
            src = dist.get_global_rank(self.gather_group, 0)
            dist.broadcast(tensor, src=src, group=self.gather_group)
        return tensor
