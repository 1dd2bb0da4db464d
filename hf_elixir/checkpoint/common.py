"""What saving and loading share: collectives that let every rank agree before anything
changes, the split of a state dict into chunked and whole tensors, JSON values, and the
frozen weights' digests (computed collectively from each rank's shards).

Every collective step of a save or load is a local part on each rank followed by one
agreement (``LocalPart.run`` then ``agree``): an exception of any type in one rank's part,
a ``ValueError`` from a tokenizer's ``save_pretrained`` as much as an ``OSError``, reaches
every rank as an error at the agreement, so no rank waits for a collective the failing rank
never joins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

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


@dataclass
class LocalPart:
    """What one rank's local part of a collective operation returned or raised (``run``),
    held until ``agree`` has told every rank whether any part failed."""

    value: Any = None
    error: Optional[BaseException] = None

    @classmethod
    def run(cls, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> "LocalPart":
        """Call ``fn``, keeping any exception, of any type: one that escaped here would leave
        the other ranks waiting in the next collective until the process group times out."""
        try:
            return cls(value=fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - re-raised by agree() once every rank knows
            return cls(error=e)


def agree(comm, part: LocalPart, what: str, share: Any = None) -> list[Any]:
    """Collective: every rank learns whether any rank's ``part`` failed, and each rank's
    ``share`` (rank order) comes back when none did.

    On a failure every rank raises, at once: the failing rank its own exception, with its
    traceback (an ``OSError`` becomes a ``CheckpointError`` saying ``what`` failed, with the
    ``OSError`` as its cause; a ``CheckpointError`` is raised as it is), and every other rank a
    ``CheckpointError`` with the failing rank's message and number. ``what`` says what was
    being done (it opens the messages of errors other than ``CheckpointError``)."""
    message = None if part.error is None else _message(part.error, what)
    gathered = all_gather_object(comm, (message, share if part.error is None else None))
    if part.error is not None:
        if isinstance(part.error, OSError):
            raise CheckpointError(message) from part.error
        raise part.error
    for rank, (other, _) in enumerate(gathered):
        if other is not None:
            raise CheckpointError(f"{other} (reported by rank {rank})")
    return [value for _, value in gathered]


def _message(error: BaseException, what: str) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    if isinstance(error, OSError):
        return f"{what}: {error}"
    return (f"{what}: {type(error).__name__}: {error} (not a checkpoint problem this code "
            "anticipated: the traceback is in that rank's output)")


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
    part = LocalPart.run(frz.local_partials, emodel, dtypes)
    partials = agree(emodel.comm, part, "computing the frozen weights' digests", share=part.value)
    return frz.combine(partials, [s.name for s in frz.frozen_slots(emodel)], dtypes)


def whole_tensors(emodel) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``untracked_tensors`` of a runtime's model: the state-dict entries its chunks do not hold."""
    return untracked_tensors(wrapped_module(emodel), chunked_tensors(emodel))
