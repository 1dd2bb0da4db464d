"""Frozen weights in checkpoints: recorded by name, shape and digest, never stored.

A frozen parameter (``requires_grad=False``: a PEFT base model, frozen embeddings) lives in
a frozen chunk and never changes during training, so a checkpoint need not hold it: the
model a checkpoint is loaded into already has it, from the same pretrained weights. Storing
it anyway would make every LoRA checkpoint as large as the base (26 GB for a 13B model in
bf16, for a few MB of adapters). Instead the index records, per frozen parameter, its name,
shape, dtype and a digest of its values, and a load refuses a model whose frozen
parameters have other names, shapes or digests (another base), before anything changes.

The digest must not depend on the world size or the plan: a run saved on 2 ranks with one
chunking resumes on 1 rank with another and must find the same digest. Hashing the bytes
of each rank's shards would depend on where the shard boundaries fall, and a sequential hash
(sha256) of each whole parameter would need the parameter gathered onto one rank (a pass of
the whole base over the network, then hashed on the host). The fingerprint here is instead
a *sum over elements* of a mixed function of (position in the parameter, bit pattern of the
value), modulo 2**32, in two lanes with different seeds (64 bits)::

    digest(p) = sum_i mix(key(i) ^ bits(p[i]))  mod 2**32,   key(i) = i * odd + seed   (per lane)

A sum does not care which rank holds which element or in which order they are visited: each
rank adds up the elements of its own shards (their positions in the parameter are known from
the chunk layout), and the ranks' partial sums are added. Nothing is gathered, the base never
leaves the device it is on, and the work is about twenty elementwise int64 operations per
element on the compute device (shards offloaded to CPU memory are copied to the GPU piece by
piece and hashed there). On a CPU device that is about 0.1 GB of values per second per
thread (measured; seconds for a model that trains on CPUs); it runs once per save and once
per load. ``mix`` is a bijection on 32-bit words (xor-shifts and odd multipliers), so
changing any single element changes the sum; for unrelated values the lanes collide with
probability about 2**-64. It detects accidental mismatches (another base, another revision
of it, a different quantisation); it is not a cryptographic hash and does not resist a
deliberately forged base. The multipliers are below 2**31, so every intermediate product of
a 32-bit word stays below 2**63: int64 arithmetic never overflows and the result is the same
on the CPU and on a GPU.

Values are digested in the dtype the runtime holds them in (the compute dtype). A run held
in float32 also records the digests of its values rounded to bfloat16 and float16, so a
resume with a lower compute dtype can still be checked; a float32 model loading a bf16
checkpoint rounds its own values to bf16 to compare. Other combinations (bf16 saved, fp16
loaded) cannot be compared exactly and are refused with the dtype to use.

Packed 4-bit weights (QLoRA's base, ``profile.params.is_packed``) are bit patterns that a
chunk of any dtype holds byte for byte: rounding them means nothing, and their elements in a
float32 chunk are not those of a bf16 one. They are digested as their bytes at their byte
positions (``tensor_digest(weight.view(torch.uint8))``), the same under every dtype key, so
a resume in another compute dtype compares the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hf_elixir.checkpoint.errors import CheckpointError
from hf_elixir.checkpoint.io import dtype_from_name, dtype_name
from hf_elixir.profile.params import is_packed
from hf_elixir.runtime import state

FINGERPRINT = "sum-fmix32x2-v1"
_MASK = 0xFFFFFFFF
_MUL1, _MUL2 = 0x7FEB352D, 0x2C1B3C6D  # odd, < 2**31: a 32-bit word times one fits in int64
_SEEDS = (0x9E3779B9, 0x85EBCA77)
_KEY_MUL = (0x5BD1E995, 0x27D4EB2F)     # odd, < 2**31: per-lane position keys
# elements per pass, which bounds the int64 temporaries: small on the CPU, where they then
# stay in cache (about 1.5x faster than 1M-element pieces), larger on a GPU (fewer launches,
# about 100 MB of temporaries)
_PIECE = {"cpu": 1 << 16}
_PIECE_DEVICE = 1 << 21
# the lower-precision dtypes a float32 run also records digests for
_ROUNDED = {torch.float32: (torch.bfloat16, torch.float16)}


@dataclass(frozen=True)
class FrozenRecord:
    """What the index says about one frozen parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str                  # the parameter's dtype before wrapping
    numel: int
    digests: dict[str, str]     # held dtype name -> 16 hex digits

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "numel": self.numel,
                "digest": dict(self.digests)}


@dataclass(frozen=True)
class SavedFrozen:
    """The ``frozen`` entry of an index: how the digests were made and one record per parameter."""

    fingerprint: str
    held_dtype: str
    records: dict[str, FrozenRecord]

    @property
    def nbytes(self) -> int:
        """Bytes of the frozen values as they were held (what the checkpoint does not store)."""
        return sum(r.numel for r in self.records.values()) * dtype_from_name(self.held_dtype).itemsize

    @classmethod
    def from_index(cls, index: dict, where: str) -> Optional["SavedFrozen"]:
        """The index's frozen entry (None when the checkpoint was saved without frozen chunks)."""
        entry = index.get("frozen")
        if entry is None:
            return None
        try:
            records = {}
            for r in entry["params"]:
                records[r["name"]] = FrozenRecord(r["name"], tuple(int(d) for d in r["shape"]), str(r["dtype"]),
                                                  int(r["numel"]), {str(k): str(v) for k, v in r["digest"].items()})
            return cls(str(entry["fingerprint"]), str(entry["held_dtype"]), records)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointError(f"{where}: the index's 'frozen' entry is malformed; the checkpoint is "
                                  "corrupted") from None


# ---------------------------------------------------------------------- the runtime's frozen state
def frozen_slots(emodel) -> list[state.ParameterLayout]:
    """Every frozen parameter, in the plan's parameter order."""
    return state.parameter_layouts(emodel, frozen=True)


def held_dtype(emodel) -> torch.dtype:
    """The dtype frozen shards are held in (the compute dtype)."""
    return state.frozen_dtype(emodel)


def digest_dtypes_for_save(held: torch.dtype) -> list[torch.dtype]:
    return [held, *_ROUNDED.get(held, ())]


def compare_dtype(own_held: torch.dtype, saved: SavedFrozen) -> Optional[torch.dtype]:
    """The dtype both sides have a digest in: this model's held dtype if the checkpoint
    recorded it, else a lower one this model's values round to exactly as the saving run's
    did. None: no exact comparison exists."""
    recorded = set.intersection(*(set(r.digests) for r in saved.records.values()))
    for dtype in (own_held, *_ROUNDED.get(own_held, ())):
        if dtype_name(dtype) in recorded:
            return dtype
    return None


# ---------------------------------------------------------------------- the fingerprint
def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection on 32-bit words held in int64 (in place)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_MUL1).bitwise_and_(_MASK)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_MASK)
    x.bitwise_xor_(x >> 16)
    return x


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The bit pattern of each element as a 32-bit word in int64."""
    size = values.element_size()
    if size == 4:
        return values.view(torch.int32).to(torch.int64).bitwise_and_(_MASK)
    if size == 2:
        return values.view(torch.int16).to(torch.int64).bitwise_and_(0xFFFF)
    if size == 1:
        return values.view(torch.uint8).to(torch.int64)
    if size == 8:
        wide = values.view(torch.int64)
        return (wide & _MASK).bitwise_xor_(_mix((wide >> 32) & _MASK))
    raise CheckpointError(f"cannot digest frozen values of dtype {values.dtype}")


def _lane_sums(values: torch.Tensor, first: int, device: Optional[torch.device] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Per lane, the sum of the terms of ``values`` (1-D; rounded to ``dtype`` if given),
    whose first element is element ``first`` of its parameter; an int64 tensor of 2 on
    ``device`` (default: the values'), where the work runs (pieces of ``values`` are copied
    and cast there, so no copy of the whole tensor is made).

    A lane's position key is ``(i * odd + seed) mod 2**32``, distinct for every position below
    2**32 (beyond, the high word is mixed in); the strength is in the ``mix`` of key ^ value."""
    device = values.device if device is None else device
    total = torch.zeros(2, dtype=torch.int64, device=device)
    mul = torch.tensor(_KEY_MUL, dtype=torch.int64, device=device).view(2, 1)
    seeds = torch.tensor(_SEEDS, dtype=torch.int64, device=device).view(2, 1)
    step = _PIECE.get(device.type, _PIECE_DEVICE)
    for start in range(0, values.numel(), step):
        piece = values[start : start + step].to(device)
        if dtype is not None and piece.dtype != dtype:
            piece = piece.to(dtype)
        pos = torch.arange(first + start, first + start + piece.numel(), dtype=torch.int64, device=device)
        key = (pos & _MASK) * mul                                     # [2, n], < 2**63
        key.add_(seeds).bitwise_and_(_MASK)
        if first + start + piece.numel() - 1 > _MASK:                 # parameters beyond 4G elements
            key = _mix(key.bitwise_xor_(pos >> 32))
        terms = _mix(key.bitwise_xor_(_bits(piece)))
        total += terms.sum(dim=1)                                     # < 2**53 per piece: no overflow
        total.bitwise_and_(_MASK)
    return total


def _hex(lanes: list[int]) -> str:
    return "".join(f"{v & _MASK:08x}" for v in lanes)


def tensor_digest(values: torch.Tensor, dtype: Optional[torch.dtype] = None) -> str:
    """The digest of a whole parameter (any shape), as ``save`` records it for a parameter held
    in ``values.dtype`` (or rounded to ``dtype``). For tests and tools that have the full tensor."""
    return _hex(_lane_sums(values.detach().reshape(-1).contiguous(), 0, dtype=dtype).tolist())


def packed_nbytes(emodel) -> dict[str, int]:
    """The frozen parameters that are packed 4-bit weights, with their size in bytes (a chunk
    may hold a few padding bytes after them, which are not theirs)."""
    packed = {n for n, p in state.wrapped_module(emodel).named_parameters() if is_packed(p)}
    return {s.name: math.prod(s.shape) * s.dtype.itemsize for s in frozen_slots(emodel) if s.name in packed}


def local_partials(emodel, dtypes: list[torch.dtype]) -> dict[str, dict[str, list[int]]]:
    """This rank's share of every frozen parameter's digest, per dtype: the lane sums over the
    elements of its own frozen shards (no collective; parameters with no element here are
    absent). Combine the ranks' partials with ``combine``. A packed 4-bit weight's share is
    the sum over its bytes, the same for every dtype."""
    out: dict[str, dict[str, list[int]]] = {}
    device = state.compute_device(emodel)
    device = device if device.type != "cpu" else None
    packed = packed_nbytes(emodel)
    for piece in state.local_slices(emodel, frozen=True):
        if piece.frozen:
            per_dtype = out.setdefault(piece.name, {})
            if piece.name in packed:  # its bytes, at their positions in the weight's bytes
                first = piece.begin * piece.master.element_size()
                raw = piece.master.view(torch.uint8)[: max(0, packed[piece.name] - first)]
                per_sums = dict.fromkeys(dtypes, _lane_sums(raw, first, device).tolist())
            else:
                per_sums = {dtype: _lane_sums(piece.master, piece.begin, device, dtype).tolist() for dtype in dtypes}
            for dtype, sums in per_sums.items():
                have = per_dtype.setdefault(dtype_name(dtype), [0, 0])
                per_dtype[dtype_name(dtype)] = [(a + s) & _MASK for a, s in zip(have, sums)]
    return out


def combine(partials: list[dict[str, dict[str, list[int]]]], names: list[str],
            dtypes: list[torch.dtype]) -> dict[str, dict[str, str]]:
    """Add the ranks' partial sums: name -> dtype name -> digest (the same on every rank)."""
    out: dict[str, dict[str, str]] = {}
    for name in names:
        digests = {}
        for dtype in dtypes:
            key = dtype_name(dtype)
            lanes = [0, 0]
            for part in partials:
                got = part.get(name, {}).get(key)
                if got is not None:
                    lanes = [(a + g) & _MASK for a, g in zip(lanes, got)]
            digests[key] = _hex(lanes)
        out[name] = digests
    return out


def index_entry(emodel, digests: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The index's ``frozen`` entry for this model, from the combined digests."""
    records = [FrozenRecord(s.name, tuple(s.shape), dtype_name(s.dtype), s.numel, digests[s.name])
               for s in frozen_slots(emodel)]
    return {"fingerprint": FINGERPRINT, "held_dtype": dtype_name(held_dtype(emodel)),
            "params": [r.to_dict() for r in records]}


def digest_mismatch(saved: SavedFrozen, own: dict[str, dict[str, str]], dtype: torch.dtype,
                    where: str) -> Optional[str]:
    """The refusal message when this model's frozen digests differ from the checkpoint's."""
    key = dtype_name(dtype)
    wrong = [n for n, d in own.items() if saved.records[n].digests.get(key) != d[key]]
    if not wrong:
        return None
    first = wrong[0]
    listed = ", ".join(repr(n) for n in wrong[:5]) + (", ..." if len(wrong) > 5 else "")
    return (
        f"{where}: this model's frozen weights are not those the checkpoint was trained on (another "
        f"base model?): {first!r} has digest {own[first][key]} here and {saved.records[first].digests[key]} "
        f"in the checkpoint ({key} values; {len(wrong)} of {len(own)} frozen tensors differ: {listed}). "
        "The checkpoint stores only the trainable state, so it resumes only onto the same frozen "
        "weights: build the model from the base it was trained from (nothing was changed)"
    )
