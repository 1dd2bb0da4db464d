"""Which hooks on a model are its user's, and keeping them out of planning's synthetic steps.

Planning runs the model's forward and backward on batches nobody trains on: a meta copy's
step, and where the meta device cannot run the model, one step of the real model
(``profile.needs``). A hook the user registered to count, log or collect statistics (or an
optimizer stepped from a post-accumulate-grad hook) must not see those steps, so they run
with the user's hooks set aside.

Hooks a library registered stay, because they change what the model computes and so what the
trace must see: transformers' ``enable_input_require_grads`` hook (checkpointing a frozen
base needs it), PEFT's and Accelerate's, torch's own (spectral and weight norm, pruning),
and hf_elixir's runtime hooks. A hook belongs to the package its function (or its bound
method's function, a partial's function, a callable object's class) was defined in; every
package not in ``LIBRARY_PACKAGES`` counts as the user's. Global hooks
(``torch.nn.modules.module.register_module_forward_hook``) are left alone.
"""

from __future__ import annotations

import functools
from typing import Any, MutableMapping

from torch import nn

#: top-level packages whose hooks change what a model computes: kept during planning's steps
LIBRARY_PACKAGES = frozenset({"hf_elixir", "torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl"})
#: a module's hook tables whose hooks run in its forward or backward
MODULE_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
#: a parameter's hook tables: ``register_hook`` and ``register_post_accumulate_grad_hook``
PARAMETER_HOOK_TABLES = ("_backward_hooks", "_post_accumulate_grad_hooks")


def hook_package(hook: Any) -> str:
    """The top-level package ``hook`` was defined in ("" when it cannot be told)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    func = getattr(hook, "__func__", hook)  # a bound method: its function
    name = getattr(func, "__module__", None)
    if not isinstance(name, str):
        name = getattr(type(hook), "__module__", "")  # a callable object: its class
    return (name or "").partition(".")[0]


def is_user_hook(hook: Any) -> bool:
    """Whether ``hook`` is the user's (not from a package in ``LIBRARY_PACKAGES``)."""
    return hook_package(hook) not in LIBRARY_PACKAGES


def hook_tables(model: nn.Module) -> list[MutableMapping[Any, Any]]:
    """Every table of hooks that run in a step of ``model``: its modules' and its parameters'.

    The tables are the objects torch reads (a leaf tensor's C++ side holds its dict), so
    they are emptied and refilled in place, never replaced."""
    tables: list[MutableMapping[Any, Any]] = []
    for module in model.modules():
        tables += [getattr(module, name) for name in MODULE_HOOK_TABLES if getattr(module, name, None) is not None]
    for p in model.parameters():
        tables += [getattr(p, name) for name in PARAMETER_HOOK_TABLES if getattr(p, name, None) is not None]
    return tables


def drop_user_hooks(model: nn.Module) -> nn.Module:
    """Remove the user's hooks from ``model``: for good from a copy that only planning runs,
    or for one step of the real model inside ``profile.untouched.left_as_found``, which puts
    them back."""
    for table in hook_tables(model):
        for key in [k for k, hook in table.items() if is_user_hook(hook)]:
            del table[key]
    return model
