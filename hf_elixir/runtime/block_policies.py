"""A plan's activation policy per block, applied through the model's own checkpointing switch.

Transformers' decoder layers (subclasses of its ``GradientCheckpointingLayer``) run their
forward through ``self._gradient_checkpointing_func(forward, *args)`` when their
``gradient_checkpointing`` flag is on, in training with gradients enabled; the model's
``activation_checkpointing_enable`` sets both on every layer. That per-layer seam is where a
plan's ``block_policies`` (``ElixirPlan.policy_of``) take effect, block by block:

- ``keep``: the flag off; autograd keeps what it saves on the device.
- ``recompute``: the flag on with the model's own function (checkpointing, as a plan with
  ``activation_checkpointing`` runs every block).
- ``recompute_offload``: the model's own function, run inside the offloader's block context
  (``runtime/activation_offload.py``): the input the checkpoint saves goes to host memory.
- ``offload``: the flag on with a function that runs the forward as it is (no recompute)
  inside that context: everything the block saves goes to host memory.

A plan without ``block_policies`` leaves every layer as the model's switch set it (the
runtime turns the switch on for ``activation_checkpointing``, as before). Each layer's own
flag and function are remembered and put back when another plan is adopted.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_elixir.planner.record import ElixirPlan, PlanError
from hf_elixir.runtime.activation_offload import ActivationOffloader

#: the class Transformers' checkpointable decoder layers derive from (read by name: the
#: runtime does not import transformers)
CHECKPOINTING_LAYER = "GradientCheckpointingLayer"
_FLAG, _FUNC = "gradient_checkpointing", "_gradient_checkpointing_func"


def checkpointing_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The model's checkpointable blocks (its decoder layers) by module name, in order."""
    return {name: m for name, m in model.named_modules()
            if any(c.__name__ == CHECKPOINTING_LAYER for c in type(m).__mro__)}


def uses_checkpointing(plan: ElixirPlan) -> bool:
    """Whether ``plan`` needs the model's checkpointing switch on: it checkpoints every
    block, or some block's policy runs through the switch (all but ``keep`` do)."""
    return plan.activation_checkpointing or any(p != "keep" for p in plan.block_policies.values())


def check_block_policies(model: nn.Module, plan: ElixirPlan) -> None:
    """Raise PlanError, saying what to change, if ``plan.block_policies`` cannot run on ``model``
    (before anything is changed)."""
    if not plan.block_policies:
        return
    blocks = checkpointing_blocks(model)
    unknown = [name for name in plan.block_policies if name not in blocks]
    if unknown:
        some = ", ".join(list(blocks)[:3]) + (" ..." if len(blocks) > 3 else "")
        raise PlanError(
            f"block_policies names {unknown[:3]}, which {'are' if len(unknown) > 1 else 'is'} not a "
            f"checkpointable block of {type(model).__name__} "
            + (f"(its blocks: {some}); name those" if blocks else
               "(it has none: no layer derives from Transformers' GradientCheckpointingLayer); "
               "make a plan without block_policies"))
    if uses_checkpointing(plan) and not getattr(model, "supports_gradient_checkpointing", True):
        raise PlanError(f"block_policies recompute or offload blocks, but {type(model).__name__} does not "
                        "support activation checkpointing; make a plan whose blocks all 'keep'")


def _recompute_offloaded(run_checkpointed: Callable, offloader: ActivationOffloader, name: str) -> Callable:
    def run(function: Callable, *args: Any, **kwargs: Any) -> Any:
        with offloader.block(name):
            return run_checkpointed(function, *args, **kwargs)
    return run


def _offloaded(offloader: ActivationOffloader, name: str) -> Callable:
    def run(function: Callable, *args: Any, **kwargs: Any) -> Any:
        with offloader.block(name):
            return function(*args, **kwargs)
    return run


class BlockPolicies:
    """Sets each block's checkpointing flag and function as a plan says (module docstring)."""

    def __init__(self, model: nn.Module, offloader: ActivationOffloader) -> None:
        self.model = model
        self.offloader = offloader
        #: block -> its own (flag, function) as instance attributes (None: the class's)
        self._own: dict[nn.Module, tuple[Optional[Any], Optional[Any]]] = {}
        self.policies: dict[str, str] = {}

    def apply(self, plan: ElixirPlan) -> None:
        """Give every block its policy under ``plan`` (the model's switch, when a policy needs
        it, is already on: ``uses_checkpointing``)."""
        self.restore()
        if not plan.block_policies:
            return
        for name, block in checkpointing_blocks(self.model).items():
            policy = plan.policy_of(name)
            self._own[block] = (block.__dict__.get(_FLAG), block.__dict__.get(_FUNC))
            own = getattr(block, _FUNC, None) or functools.partial(checkpoint, use_reentrant=False)
            setattr(block, _FLAG, policy != "keep")
            if policy == "recompute":
                setattr(block, _FUNC, own)
            elif policy == "recompute_offload":
                setattr(block, _FUNC, _recompute_offloaded(own, self.offloader, name))
            elif policy == "offload":
                setattr(block, _FUNC, _offloaded(self.offloader, name))
            self.policies[name] = policy

    def restore(self) -> None:
        """Put back each block's own flag and function."""
        for block, values in self._own.items():
            for attr, value in zip((_FLAG, _FUNC), values):
                if value is None:
                    block.__dict__.pop(attr, None)
                else:
                    setattr(block, attr, value)
        self._own.clear()
        self.policies = {}


__all__ = ["BlockPolicies", "CHECKPOINTING_LAYER", "check_block_policies", "checkpointing_blocks",
           "uses_checkpointing"]
