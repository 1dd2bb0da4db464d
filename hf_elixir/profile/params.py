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


def chunked_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters that chunks hold: every floating-point parameter, each once (tied ones
    once). Trainable ones go to trainable chunks, frozen ones (``requires_grad=False``) to
    frozen chunks; a chunk never mixes the two, so no gradient memory is spent on frozen
    weights. Non-floating parameters (quantised storage) stay whole on every rank."""
    return [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]


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
