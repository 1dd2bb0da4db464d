"""What saving and loading share: collectives that let every rank agree before anything
changes, the split of a state dict into chunked and whole tensors, JSON values, and the
frozen weights' digests (computed collectively from each rank's shards)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from hf_elixir.checkpoint import frozen as frz
from hf_elixir.checkpoint.errors import CheckpointError
from hf_elixir.runtime.state import chunked_tensors, wrapped_module


def all_gather_object(comm, obj: Any) -> list[Any]:
    if not comm.distributed:
        return [obj]
    out: list[Any] = [None] * comm.world_size
    dist.all_gather_object(out, obj, group=comm.gather_group)
    return out


def raise_if_any(comm, error: Optional[str]) -> None:
    """Every rank raises if any rank failed, so no rank changes state or waits forever."""
    errors = all_gather_object(comm, error)
    for rank, message in enumerate(errors):
        if message is not None:
            suffix = f" (reported by rank {rank})" if comm.distributed and rank != comm.rank else ""
            raise CheckpointError(message + suffix)


def untracked_tensors(module: torch.nn.Module, slot_ids: set[int]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State-dict entries that are not chunked (frozen parameters, persistent buffers), each
    once, and the aliases (tied keys) of every entry, chunked or not."""
    tensors: dict[str, torch.Tensor] = {}
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    slot_name = {}
    for name, p in module.named_parameters():
        slot_name.setdefault(id(p), name)
    for key, value in module.state_dict(keep_vars=True).items():
        if value is None:
            continue
        vid = id(value)
        if vid in slot_ids:
            if slot_name.get(vid) != key:
                aliases[key] = slot_name[vid]
            continue
        if vid in canonical:
            aliases[key] = canonical[vid]
            continue
        canonical[vid] = key
        tensors[key] = value.detach()
    return tensors, aliases


def to_json_value(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"__tensor__": value.item()}
    if isinstance(value, (tuple, list)):
        return [to_json_value(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json_value(v, where) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"{where}: cannot store a value of type {type(value).__name__} ({value!r:.80}) "
                          "in a checkpoint; only numbers, strings, lists and dicts are saved")


def from_json_value(value: Any, like: Any = None) -> Any:
    if isinstance(value, dict) and set(value) == {"__tensor__"}:
        return torch.tensor(value["__tensor__"])
    if isinstance(value, list) and isinstance(like, tuple):
        return tuple(value)
    return value


def frozen_digests(emodel, dtypes: list[torch.dtype]) -> dict[str, dict[str, str]]:
    """Every frozen parameter's digest in each of ``dtypes`` (collective; the same result on
    every rank). A rank that cannot compute its share makes every rank raise."""
    partial, error = None, None
    try:
        partial = frz.local_partials(emodel, dtypes)
    except CheckpointError as e:
        error = f"rank {emodel.comm.rank}: {e}"
    parts = all_gather_object(emodel.comm, (partial, error))
    errors = [e for _, e in parts if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    return frz.combine([p for p, _ in parts], [s.name for s in frz.frozen_slots(emodel)], dtypes)


def whole_tensors(emodel) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``untracked_tensors`` of a runtime's model: the state-dict entries its chunks do not hold."""
    return untracked_tensors(wrapped_module(emodel), chunked_tensors(emodel))
