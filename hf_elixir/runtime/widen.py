"""Adding a compute-dtype gradient into an fp32 shard on the host, at the speed of a cast.

On a CPU, PyTorch's in-place add of a bf16 (or fp16) tensor into an fp32 one takes a
mixed-dtype path several times slower than a cast followed by an fp32 add: on a 2-core VM,
8M elements took 26 ms one way against 4 ms the other, which made the add of downloaded
gradients the host's largest cost in an offloaded step (``measure/host_rate.py``). So the
source is widened one block at a time into an fp32 scratch of one block, and added from
there. The result is the mixed add's bit for bit: widening bf16 or fp16 to fp32 is exact,
and both ways then add (``target + alpha * source``) in fp32, rounding once; the tests hold
it to that for several ``alpha``.

Devices other than the CPU, a source no narrower than the target (narrowing it first would
round twice), and small tensors (where two kernel calls cost more than the slow path saves)
take the plain add.
"""

from __future__ import annotations

import torch

#: elements widened per block: large enough that the per-block calls are negligible, small
#: enough that the scratch (4 MiB of fp32) is nothing beside a chunk
BLOCK = 1 << 20
#: below this many elements the plain mixed add is as fast as the two calls
SMALL = 1 << 16


def add_widened(target: torch.Tensor, source: torch.Tensor, alpha: float = 1.0) -> None:
    """``target.add_(source, alpha=alpha)`` for flat tensors of equal length, computed in
    ``target``'s dtype; fast where ``source`` is narrower and both are on the CPU."""
    n = target.numel()
    if (target.device.type != "cpu" or source.device.type != "cpu" or n < SMALL
            or source.dtype.itemsize >= target.dtype.itemsize  # only a widening is exact
            or not (source.is_floating_point() and target.is_floating_point())
            or target.dim() != 1 or source.dim() != 1):
        target.add_(source, alpha=alpha)
        return
    scratch = torch.empty(min(n, BLOCK), dtype=target.dtype)
    for start in range(0, n, BLOCK):
        end = min(n, start + BLOCK)
        wide = scratch[: end - start]
        wide.copy_(source[start:end])
        target[start:end].add_(wide, alpha=alpha)
