"""Collectives over a process group, with a single-process fallback.

Two process groups carry the traffic: one for parameter all-gathers and one for gradient
reduce-scatters and the small all-reduces of the optimizer step. Gathers are issued in the
(rank-identical) fetch order and reduce-scatters in the (rank-identical) descending chunk
order, but how the two sequences interleave depends on when each rank's autograd engine
reaches a hook; separate groups make each sequence match on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


class Work:
    """A handle for a collective that may still be running (None: already done)."""

    def __init__(self, handle: Optional[object] = None) -> None:
        self._handle = handle

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None


@dataclass
class Collectives:
    """The process groups the runtime talks over; world size 1 needs no group at all."""

    rank: int
    world_size: int
    gather_group: Optional[dist.ProcessGroup] = None
    reduce_group: Optional[dist.ProcessGroup] = None

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
        return cls(rank=rank, world_size=world_size, gather_group=process_group, reduce_group=reduce_group)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Work:
        """Fill ``output`` (world_size * shard elements) with every rank's shard, in rank order."""
        if not self.distributed:
            output.copy_(shard)
            return Work()
        return Work(dist.all_gather_single(output, shard, group=self.gather_group, async_op=async_op))

    def reduce_scatter_mean(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Work:
        """``output`` receives this rank's slice of the mean of ``full`` over ranks."""
        if not self.distributed:
            output.copy_(full)
            return Work()
        return Work(
            dist.reduce_scatter_single(
                output, full, op=dist.ReduceOp.AVG, group=self.reduce_group, async_op=async_op
            )
        )

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.distributed:
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            dist.all_reduce(tensor, op=red, group=self.reduce_group)
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` with the group's first rank's copy (so all ranks start equal)."""
        if self.distributed:
            src = dist.get_global_rank(self.gather_group, 0)
            dist.broadcast(tensor, src=src, group=self.gather_group)
        return tensor
