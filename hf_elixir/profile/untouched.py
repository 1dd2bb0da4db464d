"""Run planning's one real step of a user's model and leave the model as it was found.

Where the meta device cannot run a model, ``profile.needs`` runs one forward and backward of
the real model on a synthetic batch. Everything that step could change about the model is
put back afterwards, because the user trains this very model next and a planner must not
change what the training does:

- each module's own attributes: its training flag (a submodule the user put in eval stays
  in eval, whatever the top module's flag), its activation checkpointing (transformers keeps
  it in ``gradient_checkpointing`` and ``_gradient_checkpointing_func`` on the modules), and
  any other attribute the step set;
- each module's hook tables, emptied of hooks registered during the step (enabling
  transformers' checkpointing registers ``enable_input_require_grads``' hook again) and
  holding the user's hooks again, which ``profile.user_hooks`` set aside for the step;
- every buffer, registered or not persistent, to its values (BatchNorm's running statistics
  and its count of batches), its tensor object and its place;
- every parameter's ``.grad``: the very tensor it had (the step accumulates into none of
  them), and its hook tables;
- the random number generators: the CPU's and those of each device the model lives on
  (the synthetic batch and dropout draw from them).

Parameters' values are not saved: the step computes gradients and never updates a weight.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from hf_elixir.profile.user_hooks import PARAMETER_HOOK_TABLES, drop_user_hooks


def _contents(table: dict | set) -> dict | set:
    """A copy of a table's contents (not of the objects in it), to refill it with."""
    return dict(table) if isinstance(table, dict) else set(table)


@dataclass
class _ModuleState:
    """What one module holds that a step could change."""

    module: nn.Module
    attributes: dict[str, Any]
    #: its tables (dicts and sets: children, parameters, buffers, hooks and their flags, any
    #: other), by attribute name: their contents, refilled into the same objects on restore,
    #: since hook handles and torch itself hold those objects
    tables: dict[str, tuple[dict | set, dict | set]]  # name -> (the table, its contents)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> a copy of its values


@dataclass
class _ParameterState:
    """What one parameter holds that a step could change: its gradient and its hooks."""

    param: torch.Tensor
    grad: torch.Tensor | None
    hooks: dict[str, dict[Any, Any] | None]


@dataclass
class ModelState:
    """A model's state as ``capture`` found it; ``restore`` puts it back."""

    modules: list[_ModuleState]
    params: list[_ParameterState]

    @classmethod
    def capture(cls, model: nn.Module) -> "ModelState":
        modules = []
        for m in model.modules():
            tables = {k: (v, _contents(v)) for k, v in vars(m).items() if isinstance(v, (dict, set))}
            attributes = {k: v for k, v in vars(m).items() if k not in tables}
            buffers = {name: b.detach().clone() for name, b in m._buffers.items() if b is not None}
            modules.append(_ModuleState(m, attributes, tables, buffers))
        params = []
        for p in model.parameters():
            hooks = {name: None if getattr(p, name, None) is None else dict(getattr(p, name))
                     for name in PARAMETER_HOOK_TABLES}
            params.append(_ParameterState(p, p.grad, hooks))
        return cls(modules, params)

    def restore(self) -> None:
        for state in self.modules:
            m = state.module
            for name, (table, contents) in state.tables.items():
                m.__dict__[name] = table
                table.clear()
                table.update(contents)
            for key in [k for k in vars(m) if k not in state.attributes and k not in state.tables]:
                del m.__dict__[key]  # set by the step
            for key, value in state.attributes.items():
                m.__dict__[key] = value
            with torch.no_grad():
                for name, values in state.buffers.items():
                    buffer = m._buffers[name]
                    if buffer.shape == values.shape and buffer.dtype == values.dtype:
                        buffer.copy_(values)
                    else:  # resized or recast in place
                        buffer.data = values
        for state in self.params:
            state.param.grad = state.grad
            for name, contents in state.hooks.items():
                table = getattr(state.param, name, None)
                if table is not None:
                    table.clear()
                    table.update(contents or {})


def devices_of(model: nn.Module) -> dict[str, list[int]]:
    """Device type -> the indices of the devices, other than the CPU and meta, that hold any
    of ``model``'s parameters or buffers: the generators a step on the model draws from."""
    found: dict[str, set[int]] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type in ("cpu", "meta"):
            continue
        index = t.device.index
        if index is None:
            index = getattr(torch, t.device.type).current_device()
        found.setdefault(t.device.type, set()).add(index)
    return {kind: sorted(indices) for kind, indices in found.items()}


@contextlib.contextmanager
def rng_untouched(model: nn.Module) -> Iterator[None]:
    """The CPU's random state and that of every device ``model`` lives on, restored on exit."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for kind, indices in devices_of(model).items():
            stack.enter_context(torch.random.fork_rng(devices=indices, device_type=kind))
        yield


@contextlib.contextmanager
def left_as_found(model: nn.Module) -> Iterator[nn.Module]:
    """Run a step of ``model`` inside: without the user's hooks, its parameters without
    gradients, and on exit every module, buffer, gradient, hook and random generator as it
    was on entry (see the module's docstring), whether the step succeeded or not."""
    state = ModelState.capture(model)
    try:
        with rng_untouched(model):
            drop_user_hooks(model)
            for p in model.parameters():
                p.grad = None
            yield model
    finally:
        state.restore()
