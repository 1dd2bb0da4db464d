"""The seam between the runtime and whatever saves or restores its state (checkpoints, and an
in-memory re-plan): typed views of what a rank holds, so that no caller walks chunks, slots
or the optimizer's bookkeeping itself.

A trainable parameter is held as slices: rank r owns elements ``[begin, end)`` of the
flattened parameter, in the fp32 master shard of the parameter's chunk (``ParameterLayout``
says which rank owns what; ``LocalSlice`` is one slice this rank owns, with writable views of
its master values and optimizer state). Beside the slices, the optimizer keeps per-parameter
counters (``OptimizerCounters``: the step, and whether momentum has started) and a loss
scaler. Frozen parameters have no master copy to save: their compute-dtype shards are the
model's own weights, so they appear as local slices only when asked for.

Writing master values through these views changes only the fp32 copy; ``publish_masters``
then refreshes the compute-dtype shards the forward reads, and ``release_all`` drops any
gathered copies, as a load must before and after it writes.

Every function that hands out or reads state first waits for host updates still running
behind the last step (runtime/host_update.py): a view taken then would see them half done.

Chunks on the disk tier (runtime/disk_tier.py) keep their master and optimizer state in
files: ``local_slices`` gives their slices' names and ranges with stand-in (meta) views, and
``chunk_slices`` gives real views, one chunk at a time, read into the tier's ring and, when
asked, written back; so saving or loading never holds all of the disk tier in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from hf_elixir.runtime.disk_tier import open_chunk
from hf_elixir.runtime.module import ElixirModule
from hf_elixir.runtime.optim import ElixirOptimizer


@dataclass(frozen=True)
class ParameterLayout:
    """Where one trainable parameter lives across the ranks, as a checkpoint index records it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype          #: the parameter's dtype before the runtime took it
    chunk: int
    offset: int                 #: first element inside its chunk
    numel: int
    owners: tuple[tuple[int, int, int], ...]  #: (rank, begin, end) in the flattened parameter


@dataclass(frozen=True)
class LocalSlice:
    """Elements ``[begin, end)`` of one parameter, held by this rank."""

    name: str
    slot: int                   #: the parameter's position in the plan's order
    frozen: bool
    begin: int
    end: int
    master: torch.Tensor        #: writable fp32 view (for a frozen slice: its compute-dtype shard)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  #: writable optimizer state views


@dataclass
class OptimizerCounters:
    """The optimizer's per-parameter counters for the parameters this rank holds."""

    steps: dict[str, float] = field(default_factory=dict)
    momentum_started: set[str] = field(default_factory=set)


# ---------------------------------------------------------------------- the model's side
def parameter_layouts(emodel: ElixirModule, frozen: bool = False) -> list[ParameterLayout]:
    """Every trainable parameter (every frozen one with ``frozen=True``), in the plan's order,
    with the slice each rank owns."""
    out = []
    world = emodel.comm.world_size
    for chunk in emodel.chunks:
        if chunk.frozen != frozen:
            continue
        for slot in chunk.slots:
            owners = []
            for rank in range(world):
                lo = rank * chunk.shard_size
                rng = slot.local_range(lo, lo + chunk.shard_size)
                if rng is not None:
                    b, e, pb = rng
                    owners.append((rank, pb, pb + e - b))
            out.append(ParameterLayout(name=slot.name, shape=tuple(slot.shape), dtype=slot.orig_dtype,
                                       chunk=chunk.index, offset=slot.offset, numel=slot.numel,
                                       owners=tuple(owners)))
    return out


def local_slices(emodel: ElixirModule, eoptimizer: Optional[ElixirOptimizer] = None,
                 frozen: bool = False) -> list[LocalSlice]:
    """The slices this rank holds of trainable parameters (and of frozen ones with
    ``frozen=True``), with their optimizer state views when ``eoptimizer`` is given. A slice
    of a chunk on the disk tier has stand-in views (its name, range and dtype hold; its
    values are read through ``chunk_slices``)."""
    emodel.host_updates.wait_all()
    states = eoptimizer.flat_state if eoptimizer is not None else [{} for _ in emodel.chunks]
    return [s for chunk, flat in zip(emodel.chunks, states) if not chunk.frozen or frozen
            for s in _slices(chunk, chunk.master, flat)]


def _slices(chunk, master: torch.Tensor, flat: dict[str, torch.Tensor]) -> list[LocalSlice]:
    return [LocalSlice(name=slot.name, slot=slot.index, frozen=chunk.frozen, begin=pb, end=pb + e - b,
                       master=master[b:e], state={k: v[b:e] for k, v in flat.items()} if not chunk.frozen else {})
            for slot, b, e, pb in chunk.local_slices()]


def chunk_slices(emodel: ElixirModule, eoptimizer: Optional[ElixirOptimizer] = None, frozen: bool = False,
                 write: bool = False) -> Iterator[list[LocalSlice]]:
    """``local_slices`` one chunk at a time, in the same order, with real views: a chunk on
    the disk tier is read for the time the caller holds its slices (until it asks for the
    next chunk) and, with ``write``, written back then. Nothing else runs meanwhile."""
    emodel.host_updates.wait_all()
    states = eoptimizer.flat_state if eoptimizer is not None else [{} for _ in emodel.chunks]
    for chunk, flat in zip(emodel.chunks, states):
        if chunk.frozen and not frozen:
            continue
        with open_chunk(emodel.disk, chunk, flat, write=write) as (master, state):
            yield _slices(chunk, master, state)
    if write and emodel.disk is not None:
        emodel.disk.flush()


def frozen_dtype(emodel: ElixirModule) -> torch.dtype:
    """The dtype frozen shards are held in (the compute dtype)."""
    for chunk in emodel.chunks:
        if chunk.frozen:
            return chunk.shard.dtype
    return emodel.dtype


def compute_device(emodel: ElixirModule) -> torch.device:
    """Where the runtime computes (its shards may be elsewhere when offloaded)."""
    return emodel.device


def chunked_tensors(emodel: ElixirModule) -> set[int]:
    """``id()`` of every parameter the chunks hold: the rest of the state dict (buffers,
    non-floating parameters) is saved whole."""
    return {id(s.param) for s in emodel.slots}


def parameter_shapes(emodel: ElixirModule) -> dict[str, tuple[int, ...]]:
    """Every chunked parameter's name and shape, trainable and frozen."""
    return {s.name: tuple(s.shape) for s in emodel.slots}


def wrapped_module(emodel: ElixirModule) -> nn.Module:
    """The user's model inside the runtime (its config, buffers and state-dict keys)."""
    return emodel.module


def publish_masters(emodel: ElixirModule) -> None:
    """After fp32 master values were written: refresh the compute-dtype shards from them."""
    emodel.host_updates.wait_all()
    for chunk in emodel.chunks:
        if not chunk.master_aliased:
            with open_chunk(emodel.disk, chunk) as (master, _):
                chunk.shard.copy_(master)


def release_all(emodel: ElixirModule) -> None:
    """Drop every gathered chunk, so that no stale full copy outlives a write to the shards."""
    emodel.release_all()


# ---------------------------------------------------------------------- the optimizer's side
def state_names(eoptimizer: ElixirOptimizer) -> list[str]:
    """The optimizer state every trainable shard has (frozen chunks keep none)."""
    for chunk, state in zip(eoptimizer.module.chunks, eoptimizer.flat_state):
        if not chunk.frozen:
            return list(state)
    return []


def group_parameter_names(eoptimizer: ElixirOptimizer) -> list[list[str]]:
    """Each param group's parameters by name (how a checkpoint matches groups on load)."""
    names: dict[int, str] = {}
    for name, p in eoptimizer.module.module.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), name)
    return [[names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(g["params"])] for g in eoptimizer.param_groups]


def _local_trainable(eoptimizer: ElixirOptimizer) -> Iterator[tuple[str, int]]:
    for chunk in eoptimizer.module.chunks:
        if not chunk.frozen:
            for slot, _, _, _ in chunk.local_slices():
                yield slot.name, slot.index


def read_counters(eoptimizer: ElixirOptimizer) -> OptimizerCounters:
    """The counters of the parameters this rank holds a slice of."""
    eoptimizer.module.host_updates.wait_all()
    out = OptimizerCounters()
    for name, index in _local_trainable(eoptimizer):
        out.steps[name] = float(eoptimizer.steps[index])
        if eoptimizer.momentum_started(index):
            out.momentum_started.add(name)
    return out


def step_tensor(eoptimizer: ElixirOptimizer, slot: int) -> torch.Tensor:
    """One parameter's step count as a 0-d fp32 host tensor (what a checkpoint stores)."""
    eoptimizer.module.host_updates.wait_all()
    return eoptimizer.steps[slot].detach().float().cpu().reshape(())


def write_counters(eoptimizer: ElixirOptimizer, counters: OptimizerCounters) -> None:
    """Set the counters of the parameters this rank holds; a parameter not named starts afresh."""
    eoptimizer.module.host_updates.wait_all()
    for name, index in _local_trainable(eoptimizer):
        eoptimizer.batching.set_step(index, counters.steps.get(name, 0.0))
        eoptimizer.set_momentum_started(index, name in counters.momentum_started)
