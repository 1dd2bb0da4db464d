"""A LoRA fine-tune of a model built from its config on the meta device, for planning.

Planning a LoRA run needs only the structure PEFT gives the model (a frozen base, small
trainable adapters beside its projections), never weights: ``peft.get_peft_model`` runs
under ``torch.device("meta")``, so a 13B base costs no memory. The planner then sees the
frozen base and the adapters exactly as the runtime will chunk them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from hf_elixir.profile.trace import build_meta_model


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's transformer blocks: its ``nn.ModuleList`` of same-class modules holding
    the most parameters (a list of experts inside a block holds fewer), or None."""
    best, best_size = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (name, module), size
    return best


def _is_projection(module: nn.Module) -> bool:
    """A dense projection LoRA can adapt: ``nn.Linear`` or GPT-2's transposed ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return True
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, Conv1D)


def default_lora_targets(model: nn.Module) -> list[str]:
    """The attention and MLP projections of a causal LM, found from its structure rather
    than from a table of architectures: the leaf names of the dense projections inside its
    decoder blocks (so the LM head and the embeddings are never targeted). A router (a
    projection beside a list of ``experts``) is left out: adapting it changes which expert
    runs, which LoRA recipes avoid."""
    found = decoder_blocks(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has no list of decoder blocks to find projections in; "
            "name the modules to adapt (--lora-targets q_proj,v_proj,...)"
        )
    targets: list[str] = []
    for block in found[1]:
        for name, module in block.named_modules():
            if not name or not _is_projection(module):
                continue
            parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
            if isinstance(getattr(parent, "experts", None), nn.Module):
                continue  # the router of a mixture of experts
            leaf = name.rpartition(".")[2]
            if leaf not in targets:
                targets.append(leaf)
    if not targets:
        raise ValueError(
            f"found no dense projections in the decoder blocks of {type(model).__name__}; "
            "name the modules to adapt (--lora-targets ...)"
        )
    return targets


def meta_lora_model(model_or_config: Any, r: int, targets: Sequence[str] | None = None,
                    dtype: str | torch.dtype = "bfloat16", alpha: int | None = None) -> nn.Module:
    """``peft.get_peft_model(base, LoraConfig(r=r, target_modules=targets))`` with the base
    built (or copied) on the meta device: the frozen base and the trainable adapters as the
    runtime will see them, with no memory spent on either.

    Args:
        model_or_config: a transformers config or an ``nn.Module`` (copied to meta, never changed).
        r: the adapters' rank.
        targets: module names to adapt (PEFT matches them as name suffixes); default
            ``default_lora_targets``.
        dtype: the compute dtype the base is built in.
        alpha: LoRA's scaling numerator (default ``2 r``); it changes no memory or time.

    Raises:
        ImportError: peft is not installed.
        ValueError: a bad rank, or targets that name no module of the model.
    """
    if r < 1:
        raise ValueError(f"the LoRA rank must be >= 1, got {r}")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ImportError("planning a LoRA fine-tune needs peft: pip install 'hf_elixir[peft]'") from e
    base = build_meta_model(model_or_config, dtype)
    chosen = list(targets) if targets else default_lora_targets(base)
    names = [n for n, _ in base.named_modules()]
    missing = [t for t in chosen if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        projections = sorted({n.rpartition(".")[2] for n, m in base.named_modules() if _is_projection(m)})
        raise ValueError(
            f"LoRA targets {missing} name no module of {type(base).__name__}; its projections are "
            f"{', '.join(projections)}"
        )
    config = LoraConfig(r=r, lora_alpha=alpha or 2 * r, target_modules=chosen, lora_dropout=0.0)
    with torch.device("meta"):
        return get_peft_model(base, config)


__all__ = ["decoder_blocks", "default_lora_targets", "meta_lora_model"]
