"""The cost model's memory half: predicted peak device bytes per rank by category
(``cost.py``'s docstring describes each), apart from the step-time simulation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hf_elixir.planner.packing import Placements
from hf_elixir.optimizers import spec
from hf_elixir.vocab import DTYPE_BYTES

#: fraction added to the predicted bytes for fragmentation of CUDA's caching allocator
ALLOCATOR_MARGIN = 0.05


# ---------------------------------------------------------------------- memory
@dataclass
class MemoryBreakdown:
    parameters: float
    master_weights: float
    optimizer_state: float
    gradients: float
    rcache: float
    activations: float
    buffers: float
    margin: float = 0.0
    frozen_shards: float = 0.0

    def total(self) -> float:
        return (self.parameters + self.master_weights + self.optimizer_state + self.gradients
                + self.rcache + self.activations + self.buffers + self.frozen_shards + self.margin)

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": int(self.parameters),
            "frozen_shards": int(self.frozen_shards),
            "master_weights": int(self.master_weights),
            "optimizer_state": int(self.optimizer_state),
            "gradients": int(self.gradients),
            "rcache": int(self.rcache),
            "activations": int(self.activations),
            "buffers": int(self.buffers),
            "margin": int(self.margin),
        }


def aligned_peak(live: Sequence[tuple[int, int]], buffers: Sequence[float]) -> tuple[float, float]:
    """(activation bytes, gradient buffer bytes) at the instant their sum peaks.

    Activations peak around the loss, gradient buffers later in backward, when most
    activations are already freed; adding the two peaks would count memory that never
    coexists. ``live`` is the trace's per-event activation peak, ``buffers`` the simulated
    bytes of full-chunk gradient buffers alive during the same event.
    """
    best, at = -1.0, (0.0, 0.0)
    for (_, top), buf in zip(live, buffers):
        if top + buf > best:
            best, at = top + buf, (float(top), float(buf))
    return at


def memory(elems: Sequence[int], world_size: int, compute_dtype: str, optimizer: str,
           rcache_blocks: int, placements: Placements, activation_bytes: float,
           buffer_bytes: float, context_bytes: float, grad_buffer_bytes: float,
           margin_fraction: float = ALLOCATOR_MARGIN) -> MemoryBreakdown:
    """Predicted peak device bytes per rank (see the module docstring for each category).

    ``elems``: each chunk's elements as laid out (``layout_sizes``); ``placements``: which
    are frozen and what lives on the CPU. ``buffer_bytes``: what every rank holds whole
    (buffers, non-floating parameters). ``activation_bytes`` and ``grad_buffer_bytes`` are
    taken at the same instant (``aligned_peak``).
    """
    cb = DTYPE_BYTES[compute_dtype]
    n = len(elems)
    W = world_size
    trainable = placements.trainable(n)
    on_device = [i for i in range(n) if i not in placements.param_cpu]
    dev_param_elems = sum(elems[i] for i in on_device if i not in placements.frozen) / W
    dev_frozen_elems = sum(elems[i] for i in on_device if i in placements.frozen) / W
    dev_optim_elems = sum(elems[i] for i in trainable if i not in placements.optim_cpu) / W
    aliased = compute_dtype == "float32"
    # blocks are made on first use and kept; at most rcache_blocks of them, the largest chunks
    # at worst; at world size 1 a chunk whose shard is on the device is its own block
    needing = elems if W > 1 else [elems[i] for i in sorted(placements.param_cpu)]
    blocks = sorted(needing, reverse=True)[: rcache_blocks]
    m = MemoryBreakdown(
        parameters=dev_param_elems * cb,
        frozen_shards=dev_frozen_elems * cb,
        master_weights=0.0 if aliased else dev_optim_elems * 4,
        optimizer_state=dev_optim_elems * spec(optimizer).state_bytes,
        gradients=dev_optim_elems * 4 + grad_buffer_bytes,
        rcache=sum(blocks) * cb,
        activations=activation_bytes,
        buffers=buffer_bytes,
    )
    m.margin = margin_fraction * m.total() + context_bytes
    return m
