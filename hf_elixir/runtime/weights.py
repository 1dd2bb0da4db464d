"""The model's weights out of the chunks and back: full tensors under the model's own
``state_dict`` keys, gathered from the master shards, and full tensors loaded into them.

Both are collective (every rank calls them) and both go through the fp32 master shards,
which hold the weights the optimizer updates: a compute-dtype shard is a copy of them.
A chunk holding packed 4-bit weights travels in its own dtype: their bytes are not
numbers to cast. A load checks everything before it writes anything, so a mismatched
``state_dict`` leaves the model as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Protocol

import torch
from torch import nn

from hf_elixir.runtime.chunk import Chunk, Slot
from hf_elixir.runtime.comm import Collectives
from hf_elixir.runtime.disk_tier import DiskTier, open_chunk
from hf_elixir.runtime.host_update import HostUpdates
from hf_elixir.runtime.ledger import MemoryLedger


class Wrapped(Protocol):
    """What these functions read of an ``ElixirModule`` (which imports this module)."""

    module: nn.Module
    chunks: list[Chunk]
    slots: list[Slot]
    device: torch.device
    comm: Collectives
    ledger: MemoryLedger
    disk: Optional[DiskTier]
    host_updates: HostUpdates


def gathered_chunk(em: Wrapped, chunk: Chunk) -> torch.Tensor:
    """The full values of one chunk (from the master shards), gathered collectively: in
    fp32, or for a chunk holding packed 4-bit weights in its own dtype (``Slot.view`` reads
    each parameter out)."""
    em.host_updates.wait_all()
    dtype = chunk.dtype if chunk.packed else torch.float32
    full = torch.empty(chunk.size, dtype=dtype, device=em.device)
    em.ledger.add("temporary", full.numel() * dtype.itemsize)
    try:
        with open_chunk(em.disk, chunk) as (master, _):
            em.comm.all_gather(full, master.to(em.device, dtype=dtype)).wait()
    finally:
        em.ledger.sub("temporary", full.numel() * dtype.itemsize)
    return full


def gather_state(em: Wrapped, chunks: list[Chunk], prefix: str, buffers: bool) -> dict:
    """The parameters of ``chunks`` (and, with ``buffers``, the model's buffers and
    unchunked tensors) under the model's ``state_dict`` keys, on the CPU, each in the
    dtype the model had before wrapping. One chunk is gathered at a time."""
    by_param = {}
    for chunk in chunks:
        full = gathered_chunk(em, chunk).cpu()
        for slot in chunk.slots:
            by_param[id(slot.param)] = slot.view(full).to(slot.orig_dtype).clone()
        del full
    chunked = {id(s.param) for s in em.slots}
    out = {}
    for key, value in em.module.state_dict(keep_vars=True).items():
        if id(value) in by_param:
            out[prefix + key] = by_param[id(value)]
        elif buffers and id(value) not in chunked:
            out[prefix + key] = value.detach().cpu().clone()
    return out


@dataclass
class StateKeys:
    """What a ``state_dict`` gives and lacks against the model's own keys."""

    missing: list[str]
    unexpected: list[str]
    #: id() of each of the model's tensors -> the key its value is read from (tied
    #: parameters appear under several keys; one of them is enough)
    key_of_param: dict[int, str]


def check_state_dict(em: Wrapped, state_dict: Mapping[str, torch.Tensor], strict: bool) -> StateKeys:
    """Every reason ``state_dict`` cannot be loaded, raised before anything is written:
    missing or unexpected keys (``strict``), a shape that differs from the parameter's,
    packed 4-bit codes stored in another dtype than the model packs them in."""
    own = em.module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    key_of_param: dict[int, str] = {}
    for k, v in own.items():
        if k in state_dict:
            key_of_param.setdefault(id(v), k)
    missing = [k for k in missing if id(own[k]) not in key_of_param]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"state_dict does not match the model: missing keys {missing[:5]}, "
            f"unexpected keys {unexpected[:5]}"
        )
    shapes = {id(s.param): s.shape for s in em.slots}
    for k, v in own.items():
        if k in state_dict:
            want = shapes.get(id(v), v.shape)
            if tuple(state_dict[k].shape) != tuple(want):
                raise RuntimeError(
                    f"state_dict[{k!r}] has shape {tuple(state_dict[k].shape)}, the model "
                    f"expects {tuple(want)}"
                )
    packed = {id(s.param): s for s in em.slots if s.packed}
    for k, v in own.items():
        if k in state_dict and id(v) in packed and state_dict[k].dtype != packed[id(v)].orig_dtype:
            raise RuntimeError(
                f"state_dict[{k!r}] holds packed 4-bit codes in {state_dict[k].dtype}, the model "
                f"packs them in {packed[id(v)].orig_dtype}; their bytes cannot be cast: load the "
                "weights with the model's own bnb_4bit_quant_storage"
            )
    return StateKeys(missing, unexpected, key_of_param)


def load_into_chunks(em: Wrapped, state_dict: Mapping[str, torch.Tensor], key_of_param: dict[int, str]) -> None:
    """Write ``state_dict`` (checked by ``check_state_dict``) into every chunk's master
    shard, and its compute-dtype shard where that is a copy; a parameter the dictionary
    lacks (a non-strict load) keeps its current values. Tensors in no chunk (buffers,
    8-bit storage) are copied in place. The chunks must be released: their gathered
    copies would go stale."""
    rank = em.comm.rank
    for chunk in em.chunks:
        flat = torch.zeros(chunk.size, dtype=chunk.dtype if chunk.packed else torch.float32)
        current = None
        for slot in chunk.slots:
            key = key_of_param.get(id(slot.param))
            if key is None:  # not strict and absent: keep the current values
                current = gathered_chunk(em, chunk).cpu() if current is None else current
                slot.view(flat).copy_(slot.view(current))
            else:
                slot.view(flat).copy_(state_dict[key].reshape(slot.shape))
        local = flat[rank * chunk.shard_size : (rank + 1) * chunk.shard_size]
        with open_chunk(em.disk, chunk, write=True) as (master, _):
            master.copy_(local)
        if not chunk.master_aliased:
            chunk.shard.copy_(local)
    slot_params = {id(s.param) for s in em.slots}
    for k, v in em.module.state_dict(keep_vars=True).items():
        if k in state_dict and id(v) not in slot_params:
            v.data.copy_(state_dict[k])
