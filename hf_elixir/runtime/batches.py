"""The calls one optimizer step makes: views of the flat shards, grouped into one kernel
call per (chunk updated on its own, parameter group, state device).

A parameter's gradient, master weights and optimizer state are stretches of its chunk's
flat buffers. Where neighbours in a shard are updated alike (one parameter group, the same
step count, all with a gradient) the update takes one view across them, the alignment
gaps included: one call over a flat stretch, as ``torch.optim.AdamW(fused=True)`` over one
flat tensor, instead of one per parameter (on a CPU each tensor is its own parallel loop,
and a bias of 64 elements costs one as much as a matrix). The gaps hold zeros in every
buffer (the chunk is built from zeros, a gradient buffer's gaps are zeroed before its
reduction), and Adam leaves a zero with a zero gradient at zero. SGD's momentum starts
per parameter (from its first gradient), so under SGD every parameter keeps a view of its
own.

The views are of tensors that live as long as the optimizer (a re-plan moves no shard), so
the calls of the last step are used again while the same parameters have gradients:
building a few thousand views in Python cost a deep, narrow model more than its update
(18 ms a step for 48 layers of width 64 on a CPU).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from hf_elixir.runtime.chunk import Chunk

Batches = dict[tuple, dict[str, list]]


@dataclass
class UpdateBatches:
    chunks: Sequence[Chunk]
    #: per chunk, its optimizer state by name (empty for a frozen chunk)
    flat_state: Sequence[dict[str, torch.Tensor]]
    #: per parameter (plan position), its step count; the optimizer's own dict, shared
    steps: dict[int, torch.Tensor]
    #: per parameter, the index of its group in the optimizer
    group_of_slot: dict[int, int]
    #: chunks updated on their own (their state is on the host)
    host_chunks: frozenset[int]
    #: join neighbours into one view (Adam and AdamW; not SGD)
    merge: bool = True
    _cache: Optional[tuple[bytes, Batches]] = field(default=None, repr=False)

    def get(self, active: torch.Tensor) -> Batches:
        """This step's calls for the parameters flagged in ``active`` (uint8, by plan
        position); the last step's when the same parameters had gradients."""
        pattern = active.numpy().tobytes()
        if self._cache is not None and self._cache[0] == pattern:
            return self._cache[1]
        batches = self._build(active.tolist())  # a list's items read in nanoseconds, a tensor's in microseconds
        self._cache = (pattern, batches)
        return batches

    def set_step(self, slot: int, value: float) -> None:
        """Set one parameter's step count (a load). The counts of one run are one tensor
        (``_run_step``): the parameter gets a tensor of its own, and the runs are made again."""
        old = self.steps[slot]
        self.steps[slot] = torch.full((), float(value), dtype=old.dtype, device=old.device)
        self._cache = None

    def _build(self, active: list) -> Batches:
        batches: Batches = defaultdict(lambda: defaultdict(list))
        for chunk, state in zip(self.chunks, self.flat_state):
            if chunk.frozen:
                continue
            # a chunk whose state is on the host is updated on its own: behind the next
            # forward, or (a staged chunk, CUDA device) so that its upload overlaps the
            # update of the next one
            key_chunk = chunk.index if chunk.uploads_from_staging or chunk.index in self.host_chunks else -1
            for key, begin, end, slots in self._runs(chunk, key_chunk, active):
                b = batches[key]
                b["grads"].append(chunk.grad_shard[begin:end])
                b["steps"].append(self._run_step(slots, chunk.optim_device))
                b["slots"].append(slots[0])
                b["ranges"].append((begin, end))  # where the run lies in the shard
                if chunk.disk:  # master and state views are taken once its planes are read
                    continue
                b["params"].append(chunk.master[begin:end])
                for name, flat in state.items():
                    b[name].append(flat[begin:end])
        return batches

    def _runs(self, chunk: Chunk, key_chunk: int, active: list) -> list[list]:
        """The chunk shard's parameters with a gradient, as [batch key, begin, end, slots]:
        neighbours with one key and one step count are one run when ``merge``."""
        runs: list[list] = []
        last_step: Optional[float] = None  # the previous parameter's, if it is in a run
        for slot, begin, end, _ in chunk.local_slices():  # in offset order
            group = self.group_of_slot.get(slot.index)
            if not active[slot.index] or group is None:
                last_step = None  # a parameter without a gradient is not updated: the run ends
                continue
            key = (key_chunk, group, chunk.optim_device)
            step = float(self.steps[slot.index]) if self.merge else None
            if self.merge and runs and last_step == step and runs[-1][0] == key:
                runs[-1][2] = end  # the run reaches to this parameter's end
                runs[-1][3].append(slot.index)
            else:
                runs.append([key, begin, end, [slot.index]])
            last_step = step
        return runs

    def _run_step(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """The step count of a run: a new tensor its parameters share from now on (the
        kernel adds one to it for all of them). Every parameter with a gradient gets the
        tensor of its new run, so a tensor shared in an old run is left only to parameters
        without a gradient, and no kernel call advances it for them."""
        shared = torch.full((), float(self.steps[slots[0]]), dtype=torch.float32, device=device)
        for index in slots:
            self.steps[index] = shared
        return shared


def uncovered(covered: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The stretches of ``[0, size)`` (a shard) that no range of ``covered`` (runs, as
    ``ranges`` holds them) includes: what a one-pass update left to copy."""
    out, at = [], 0
    for lo, hi in sorted(covered):
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < size:
        out.append((at, size))
    return out
