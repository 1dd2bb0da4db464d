"""The words every layer shares: compute dtypes, byte sizes, and the package's base error.

This module is the leaf of the package: it imports nothing from hf_elixir, so any layer
(profile, hardware, planner, runtime, measure, checkpoint, integrations, cli) can use it
without an arrow pointing up. A dtype or a size is spelled, parsed and printed the same way
everywhere because there is exactly one table of each, here.
"""

from __future__ import annotations

import math
import re

import torch

GiB = 2**30
GB = 10**9


class HfElixirError(Exception):
    """Base of every error hf_elixir raises on purpose: the message says what to change."""


class VocabError(HfElixirError, ValueError):
    """An unsupported dtype or an unreadable size."""


# ---------------------------------------------------------------------- dtypes
#: the compute dtypes the planner and the runtime support, by their canonical names
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: bytes per element of each compute dtype
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}


def canonical_dtype(dtype: str | torch.dtype, error: type[Exception] = VocabError) -> str:
    """The canonical name ("float32", "bfloat16", "float16") of a dtype or an alias (fp32,
    bf16, fp16, half, torch.float16, ...); ``error`` is raised, naming the choices, otherwise."""
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPES.items():
            if value == dtype:
                return name
        raise error(f"unsupported compute dtype {dtype}; use float32, bfloat16 or float16")
    key = str(dtype).lower().replace("torch.", "")
    if key not in _DTYPE_ALIASES:
        raise error(f"unsupported compute dtype {dtype!r}; use one of fp32, bf16, fp16")
    return _DTYPE_ALIASES[key]


def torch_dtype(dtype: str | torch.dtype, error: type[Exception] = VocabError) -> torch.dtype:
    """The ``torch.dtype`` of a dtype name or alias."""
    return DTYPES[canonical_dtype(dtype, error)]


# ---------------------------------------------------------------------- byte sizes
_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


#: the smallest size a number without a unit may give where a person writes sizes (a config
#: file, the command line): a memory of under 1 MiB is a unit left out (``gpu_memory: 24``)
BARE_MINIMUM = 2**20


def parse_bytes(text: str | int | float, what: str = "memory size",
                error: type[Exception] = VocabError, bare_minimum: int = 1) -> int:
    """Bytes from "24GiB", "24 GB", "24000MB", "80G" (G/GiB/MiB powers of 1024, GB/MB powers
    of 1000, as transformers reads shard sizes, B bytes) or a number of bytes; ``error``
    otherwise, naming ``what`` and the accepted forms.

    NaN, infinity, negatives and sizes below one byte ("0.5") are refused. A number without
    a unit (``24``, ``"24"``) counts bytes; below ``bare_minimum`` it is refused with "write
    a unit" (``BARE_MINIMUM`` for sizes a person writes, 1 for byte counts a program
    passes)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text):
            raise error(f"{what} must be a finite size, got {text}; write a number and a unit, e.g. '24GiB'")
        return _whole_bytes(text, text, "", what, error, bare_minimum)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise error(
            f"cannot read {what} {text!r}: write a number and a unit, e.g. '24GiB', "
            "'24 GB', '24000MB' or '80G' (GiB/MiB/G are powers of 1024, GB/MB powers of 1000)"
        )
    return _whole_bytes(float(m.group(1)) * _UNITS[unit], text, unit, what, error, bare_minimum)


def _whole_bytes(value: float, text: str | int | float, unit: str, what: str, error: type[Exception],
                 bare_minimum: int) -> int:
    """``value`` bytes as a whole number, once it is checked: positive, at least one byte,
    and, written without a unit, at least ``bare_minimum``."""
    if value <= 0:
        raise error(f"{what} must be positive, got {text!r}")
    if value < 1:
        raise error(f"{what} {text!r} is less than one byte; write a number and a unit, e.g. '24GiB'")
    if not unit and value < bare_minimum:
        number = str(text).strip()
        raise error(
            f"{what} {text!r} has no unit, so it would mean {int(value)} bytes; write a unit, "
            f"e.g. '{number}GiB' or '{number}MB' (or '{number}B' if you mean bytes)"
        )
    return int(value)


def format_bytes(n: float) -> str:
    """A byte count the way the package prints it everywhere: binary units, two decimals."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
