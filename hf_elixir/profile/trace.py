"""The order in which modules use parameters in forward and backward, and tied parameters.

The runtime fetches a module's chunks before the module runs, in forward and again in
backward (and in the recomputed forward when activation checkpointing is on). The planner
needs that sequence to pack parameters in first-use order and to replay the sequence
against the rCache. ``ExecutionTracer`` records it with module hooks:

- a forward pre-hook records ``("forward", module)`` (``"recompute"`` once backward began);
- a forward hook attaches a gradient hook to the module's output, which fires when the
  output's gradient is ready, i.e. just before the module's own backward: ``("backward",
  module)``.

Only modules that own trainable parameters directly (``recurse=False``) are recorded, because
those are the units the runtime fetches; a *fetch unit* (a mixture-of-experts block, see
``detect_fetch_units``) is recorded as one module owning its whole subtree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from hf_elixir.plan.plan import canonical_dtype, detect_fetch_units

Phase = str  # "forward" | "backward" | "recompute"


# ---------------------------------------------------------------------- meta models
def build_meta_model(model_or_config: Any, dtype: str | torch.dtype = "float32") -> nn.Module:
    """A copy of the model whose parameters and buffers live on the meta device.

    Accepts a ``transformers`` config (the model is built with ``AutoModelForCausalLM`` under
    ``torch.device("meta")``: no weights are read or allocated) or an ``nn.Module`` (deep-copied
    with every parameter and buffer replaced by a meta tensor of the same shape, so even a real
    model is never duplicated in memory; tied parameters stay tied). Floating-point parameters
    take the compute ``dtype``, as the runtime casts them.
    """
    torch_dtype = _torch_dtype(dtype)
    if isinstance(model_or_config, nn.Module):
        memo: dict[int, Any] = {}
        for p in model_or_config.parameters():
            memo[id(p)] = nn.Parameter(
                torch.empty_like(p, device="meta", dtype=torch_dtype if p.is_floating_point() else p.dtype),
                requires_grad=p.requires_grad,
            )
        for b in model_or_config.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
        meta = copy.deepcopy(model_or_config, memo)
        meta.train(model_or_config.training)
        return meta
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if not isinstance(model_or_config, PretrainedConfig):
        raise TypeError(
            f"expected an nn.Module or a transformers config, got {type(model_or_config).__name__}"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_or_config, dtype=torch_dtype)
    return model


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        canonical_dtype(dtype)
    ]


def make_batch(
    example_batch: dict[str, torch.Tensor] | tuple[int, int],
    vocab_size: int | None = None,
    device: str | torch.device = "meta",
) -> dict[str, torch.Tensor]:
    """The batch to profile with, on ``device``: same shapes and dtypes, no data copied.

    ``(batch_size, seq_len)`` becomes ``input_ids`` and ``labels``; a dict without ``labels``
    gets ``labels = input_ids`` so that the step has a loss.
    """
    if isinstance(example_batch, (tuple, list)):
        if len(example_batch) != 2:
            raise ValueError("example_batch must be a dict of tensors or (batch_size, seq_len)")
        b, s = (int(x) for x in example_batch)
        if b < 1 or s < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {(b, s)}")
        if torch.device(device).type == "meta":
            ids = torch.empty((b, s), dtype=torch.long, device=device)
        else:
            ids = torch.randint(0, vocab_size or 2, (b, s), device=device)
        return {"input_ids": ids, "labels": ids}
    if not isinstance(example_batch, dict):
        raise ValueError("example_batch must be a dict of tensors or (batch_size, seq_len)")
    out: dict[str, torch.Tensor] = {}
    for k, v in example_batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.empty_like(v, device="meta") if torch.device(device).type == "meta" else v.to(device)
        else:
            out[k] = v
    if "labels" not in out and "input_ids" in out:
        out["labels"] = out["input_ids"]
    return out


def batch_shape(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(batch_size, seq_len) of a batch dict, read from input_ids (or the first 2-D tensor)."""
    t = batch.get("input_ids")
    if t is None:
        t = next(v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2)
    return int(t.shape[0]), int(t.shape[1])


# ---------------------------------------------------------------------- parameters
def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its canonical name (the first name ``named_parameters`` gives it)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of names that refer to one parameter (e.g. GPT-2's wte and lm_head weights)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def module_parameters(model: nn.Module, fetch_units: Iterable[str] = ()) -> dict[str, list[str]]:
    """Module name -> canonical names of the trainable parameters the runtime fetches for it.

    A module owns its direct parameters; a fetch unit owns its whole subtree and its
    descendants own nothing. Modules owning nothing are left out.
    """
    names = parameter_names(model)
    units = list(fetch_units)
    owned: dict[str, list[str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        if any(mname.startswith(u + ".") for u in units):
            continue
        params = module.parameters() if mname in units else module.parameters(recurse=False)
        own: list[str] = []
        for p in params:
            if p.requires_grad and names[id(p)] not in own:
                own.append(names[id(p)])
        if own and mname not in owned:
            owned[mname] = own
    return owned


# ---------------------------------------------------------------------- tracing
@dataclass
class Trace:
    """What the runtime will fetch, in order.

    Attributes:
        events: ``(phase, module)`` in execution order, phase one of forward, backward, recompute.
        module_params: module -> canonical names of the trainable parameters it uses.
        module_flops: module -> forward matmul FLOPs of the operators run while it was the
            innermost module owning parameters (used to spread compute time over modules).
    """

    events: list[tuple[Phase, str]] = field(default_factory=list)
    module_params: dict[str, list[str]] = field(default_factory=dict)
    module_flops: dict[str, int] = field(default_factory=dict)

    def first_use_order(self, all_params: Iterable[str]) -> list[str]:
        """Parameters in the order the forward first uses them; unused ones at the end."""
        order: list[str] = []
        seen: set[str] = set()
        for phase, module in self.events:
            if phase != "forward":
                continue
            for p in self.module_params.get(module, []):
                if p not in seen:
                    seen.add(p)
                    order.append(p)
        order.extend(p for p in all_params if p not in seen)
        return order


class ExecutionTracer:
    """Module hooks that fill a ``Trace`` while the model runs one step."""

    def __init__(self, model: nn.Module, fetch_units: Iterable[str] | None = None):
        self.model = model
        self.fetch_units = list(detect_fetch_units(model) if fetch_units is None else fetch_units)
        self.trace = Trace(module_params=module_parameters(model, self.fetch_units))
        self.in_backward = False
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "ExecutionTracer":
        for name, module in self.model.named_modules():
            if name not in self.trace.module_params:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._post_hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def add_flops(self, n: int) -> None:
        if self._stack and not self.in_backward:
            top = self._stack[-1]
            self.trace.module_flops[top] = self.trace.module_flops.get(top, 0) + n

    def _pre_hook(self, name: str):
        def hook(module, args):
            self.trace.events.append(("recompute" if self.in_backward else "forward", name))
            self._stack.append(name)

        return hook

    def _post_hook(self, name: str):
        def hook(module, args, output):
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            if self.in_backward:
                return None
            fired = [False]

            def on_grad(grad):
                if not fired[0]:
                    fired[0] = True
                    self.trace.events.append(("backward", name))
                return None

            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(on_grad)
            return None

        return hook


def _tensors(obj: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    if hasattr(obj, "to_tuple"):
        obj = obj.to_tuple()
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
