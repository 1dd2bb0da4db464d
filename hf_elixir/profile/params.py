"""Which parameters a model's chunks hold, and how a model is recognised.

These answer questions about the model alone, before any plan exists, so the profile, the
planner and the runtime all ask them here: every floating-point parameter is chunked (frozen
ones in frozen chunks), mixture-of-experts blocks are fetched as one unit, and a plan names
the model it was made for by a digest of its parameter names and shapes.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
from torch import nn


def is_packed(p: torch.Tensor) -> bool:
    """Whether ``p`` is a 4-bit quantised weight packed into its storage (bitsandbytes'
    ``Params4bit``, recognised by its attributes so that nothing here imports
    bitsandbytes). Its elements are bit patterns, two 4-bit codes a byte, in whatever dtype
    the model was loaded with (``bnb_4bit_quant_storage``: uint8 by default, or a float
    dtype): they are moved byte for byte and never cast, and its quantisation state
    (scales, code book, the unpacked shape) stays on the parameter, whole on every rank."""
    return hasattr(p, "quant_state") and hasattr(p, "quant_storage") and hasattr(p, "blocksize")


def chunk_numel(p: torch.Tensor, itemsize: int) -> int:
    """Elements ``p`` takes in a chunk of ``itemsize``-byte elements: its own count, or for
    a packed weight its bytes in chunk elements (rounded up: the last one is padded)."""
    if is_packed(p):
        return -(-p.numel() * p.element_size() // itemsize)
    return p.numel()


def chunked_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters that chunks hold: every floating-point parameter and every packed
    4-bit weight (``is_packed``), each once (tied ones once). Trainable ones go to
    trainable chunks, frozen ones (``requires_grad=False``) to frozen chunks; a chunk never
    mixes the two, so no gradient memory is spent on frozen weights. Other non-floating
    parameters (8-bit quantised storage) stay whole on every rank."""
    return [(n, p) for n, p in model.named_parameters() if p.is_floating_point() or is_packed(p)]


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The chunked parameters that need gradients, each once (tied ones once)."""
    return [(n, p) for n, p in chunked_parameters(model) if p.requires_grad]


def frozen_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The chunked parameters that do not need gradients (a PEFT base, frozen layers)."""
    return [(n, p) for n, p in chunked_parameters(model) if not p.requires_grad]


def model_signature(named_params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A short digest of parameter names and shapes (and which are frozen), to recognise a
    plan made for another model. A model without frozen parameters keeps the digest it had
    before frozen chunks existed."""
    h = hashlib.sha256()
    for name, p in named_params:
        frozen = "" if p.requires_grad else ":frozen"
        h.update(f"{name}:{tuple(p.shape)}{frozen};".encode())
    return h.hexdigest()[:16]


def detect_fetch_units(model: nn.Module) -> list[str]:
    """Modules whose children run data-dependently: mixture-of-experts blocks.

    A block with a ``ModuleList`` of experts runs only the experts its router picks, and the
    pick differs between ranks. Fetching the whole block as one unit keeps every rank's
    sequence of collectives identical. Fused-expert blocks (one 3-D parameter for all
    experts) are static and need no unit.
    """
    units: list[str] = []
    for name, module in model.named_modules():
        if any(name == u or name.startswith(u + ".") for u in units):
            continue
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.ModuleList) and len(experts) > 1:
            units.append(name)
    return units
