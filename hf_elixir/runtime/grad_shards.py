"""Whole-model passes over the fp32 gradient shards: scaling, the inf/NaN check, the norm.

Each pass reads every trainable chunk's gradient shard wherever it lives: a tensor on the
device or in host memory, or, for a chunk on the disk tier, the gradient plane of its file
(read one chunk at a time, so the disk tier's gradients are never all in memory; a scaling
is recorded and applied where the plane is next read: ``disk_grads.py``; a host chunk's
clipping is left to its update, which multiplies as it reads: ``Chunk.grad_factor``).
Shards are grouped by the device that would hold them in memory, in chunk order, so a disk
chunk takes the place its host-tier twin would: the norms are summed in the same order and
the result is the same, bit for bit.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterator, Optional, Sequence, Union

import torch

from hf_elixir.runtime.chunk import Chunk
from hf_elixir.runtime.comm import Collectives
from hf_elixir.runtime.disk_tier import DiskTier

HOST = torch.device("cpu")


def by_device(chunks: Sequence[Chunk], disk: Optional[DiskTier],
              keep_factors: bool = False) -> dict[torch.device, list[Chunk]]:
    """The chunks with a non-empty gradient shard, grouped by where it lives (the host for
    a disk chunk); every gradient written to the disk tier has reached its file.
    ``keep_factors``: a pending clipping factor stays pending (``Chunk.settle_grad``)."""
    if disk is not None:
        disk.grads.settle()
    out: dict[torch.device, list[Chunk]] = defaultdict(list)
    for chunk in chunks:
        chunk.settle_grad(keep_factor=keep_factors)
        if chunk.grad_shard.numel():
            out[HOST if chunk.disk else chunk.grad_shard.device].append(chunk)
    return out


def values(chunks: Sequence[Chunk], disk: Optional[DiskTier]) -> Iterator[torch.Tensor]:
    """Each chunk's gradient shard as it stands (a disk chunk's: a scaled copy, read now)."""
    for chunk in chunks:
        yield disk.grads.read_scaled(chunk.index) if chunk.disk else chunk.grad_shard


def scale(chunks: Sequence[Chunk], disk: Optional[DiskTier], factor: Union[float, torch.Tensor],
          defer: frozenset[int] = frozenset()) -> None:
    """Multiply every gradient shard by ``factor`` (on the disk tier: recorded, applied when
    each plane is next read; for the chunks in ``defer``, whose update multiplies as it reads:
    left pending, ``Chunk.grad_factor``: ``clip``'s fp32 factor, which the loop multiplies by
    as an fp32 ``mul_`` would). The shards were settled (``by_device``), so no factor is
    pending when another is recorded."""
    for chunk in chunks:
        if chunk.disk:
            continue
        if chunk.index in defer:
            assert chunk.grad_factor is None and not chunk.grad_zeroed
            chunk.grad_factor = factor
        else:
            chunk.grad_shard.mul_(factor)
    if disk is not None and any(c.disk for c in chunks):
        disk.grads.scale(factor)


def found_inf(chunks: Sequence[Chunk], disk: Optional[DiskTier], comm: Collectives) -> bool:
    """Whether any rank has an inf/NaN gradient: one host sync per device, one all-reduce.
    A pending clipping factor is left to the update that takes it: it cannot change the
    answer. A factor in (0, 1] keeps a finite value finite and an inf or NaN one so; a
    factor of 0 (a max norm of 0, or a norm that overflowed) keeps finite values finite and
    turns inf into NaN; a NaN factor comes only from a NaN norm, which a NaN gradient made."""
    flag = torch.zeros(1, dtype=torch.float32)
    for group in by_device(chunks, disk, keep_factors=True).values():
        bad = torch.stack([torch.isfinite(g).all() for g in values(group, disk)]).logical_not().any()
        flag = torch.maximum(flag, bad.float().cpu().reshape(1))
    return bool(comm.all_reduce(flag, op="max").item())


def _norm(chunk: Chunk, disk: Optional[DiskTier], norm_type: float) -> torch.Tensor:
    """One shard's norm; a disk chunk's 2-norm as taken when its gradient was written, if
    nothing changed it since (``DiskGrads.norm``), else from the plane read back."""
    if chunk.disk:
        known = disk.grads.norm(chunk.index) if norm_type == 2.0 else None
        if known is not None:
            return known
        return torch.linalg.vector_norm(disk.grads.read_scaled(chunk.index), norm_type)
    return torch.linalg.vector_norm(chunk.grad_shard, norm_type)


def clip(chunks: Sequence[Chunk], disk: Optional[DiskTier], comm: Collectives, max_norm: float,
         norm_type: float, defer: frozenset[int] = frozenset()) -> torch.Tensor:
    """Clip like ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (one all-reduce);
    returns the total norm. ``defer``: chunks whose scaling is left to their update (``scale``).

    Where every shard is on one device (nothing offloaded), the norm, its all-reduce and the
    factor stay on that device, as in PyTorch's own clipping: the host never waits for the
    backward to finish, so on a GPU it goes on queueing the update and the next step's work.
    Where shards live on several devices, their sums meet on the host: one sync per device,
    not one per chunk (a host shard's update needs the factor there anyway)."""
    norm_type = float(norm_type)
    groups = by_device(chunks, disk)
    where = next(iter(groups)) if len(groups) == 1 else HOST  # where the devices' figures meet
    if norm_type == math.inf:
        local = torch.zeros(1, dtype=torch.float32, device=where)
        for group in groups.values():
            peak = torch.stack([g.abs().max() for g in values(group, disk)]).max()
            local = torch.maximum(local, peak.float().to(where).reshape(1))
        total = comm.all_reduce(local, op="max")[0]
    else:
        local = torch.zeros(1, dtype=torch.float64, device=where)
        for group in groups.values():
            norms = torch.stack([_norm(c, disk, norm_type) for c in group])
            local += norms.double().pow(norm_type).sum().to(where)
        total = comm.all_reduce(local, op="sum")[0].pow(1.0 / norm_type).float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for device, group in groups.items():
        scale(group, disk, coef.to(device), defer)  # one small copy per device
    return total
