"""Each block's MLP over sequence tiles (``ElixirPlan.mlp_tiles``): one tile's intermediate at a time.

At long context one decoder block's MLP intermediate (sequence x intermediate size, several
copies: the gate's and the up projection's outputs, the activation, their product, and as
many gradients in backward) is the largest thing a block makes: at 98k tokens and an
intermediate of 14,336 each copy is 2.8 GB in bf16. The MLP is position-wise (each token's
output depends on that token's input only), so it can run over the sequence in tiles and the
outputs be concatenated: the result is the same. Each tile runs under ``torch.utils.checkpoint``
(non-reentrant), which keeps only the tile's input; in backward autograd finishes one tile
(recompute, then its backward) before it starts the next, since every node of a later tile is
newer, so one tile's intermediate exists at a time, in either pass.

Which module is the MLP (a generic rule; the runtime does not import transformers): in each
checkpointable block (``block_policies.checkpointing_blocks``: the decoder layers), the
direct child named one of ``profile.blocks.MLP_NAMES``, the names whose rise the planner
divides by the tile count (``mlp`` in Llama, Mistral, Qwen, Gemma, Phi, GPT-2;
``feed_forward`` in Llama 4 and others; ``ffn``). It is tiled only when its forward takes one
argument (the hidden states) and it is not a fetch unit (a block with routing, as a
mixture-of-experts layer: its router's outputs are recorded per call and its experts run
only where tokens are routed, so it is refused with a line that says what to do rather than
tiled). A model without such a child runs its MLPs whole, and ``MlpTiles.note`` says so (with
one warning). A block whose plan policy is ``offload`` runs its MLP whole: everything it saves
goes to host memory anyway, and the planner prices tiles only for blocks that recompute.

The tile count is read from the runtime's current plan at every call, so a recovery that
adopts another plan takes effect at once; the wrapper is installed when the plan the runtime
starts with asks for tiles. Tiles split the second-to-last dimension (the sequence of a
``(batch, sequence, hidden)`` or ``(sequence, hidden)`` input), with ``torch.tensor_split``,
always into the count (a shorter sequence leaves some tiles empty), so every rank calls the
MLP's modules as often whatever its sequence length. The MLP's own modules are called
as in the whole forward, once per tile, so the chunk runtime's module hooks fetch their
parameters for each tile and again for each tile's recomputation.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_elixir.planner.record import ElixirPlan, PlanError
from hf_elixir.profile.blocks import MLP_NAMES  # the names the profiler marks (and the planner tiles)
from hf_elixir.runtime.block_policies import checkpointing_blocks


def find_mlps(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Each block's MLP by its module name: (its block's name, the MLP), in block order."""
    found: dict[str, tuple[str, nn.Module]] = {}
    for block_name, block in checkpointing_blocks(model).items():
        for child_name, child in block.named_children():
            if child_name in MLP_NAMES:
                found[f"{block_name}.{child_name}"] = (block_name, child)
                break
    return found


def _takes_one_tensor(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes exactly one argument, positionally (the hidden states)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)


def check_mlp_tiles(model: nn.Module, plan: ElixirPlan) -> None:
    """Raise PlanError, saying what to change, if ``plan.mlp_tiles`` cannot run on ``model``'s
    MLPs (before anything is changed): an MLP whose forward takes more than the hidden states,
    or one with routing (a fetch unit, or inside one)."""
    if plan.mlp_tiles <= 1:
        return
    units = [u for u in plan.fetch_units if u]
    for name, (_, mlp) in find_mlps(model).items():
        routed = any(name == u or name.startswith(u + ".") or u.startswith(name + ".") for u in units)
        if routed or not _takes_one_tensor(mlp):
            why = ("it routes tokens (a fetch unit: mixture-of-experts)" if routed else
                   f"its forward{inspect.signature(mlp.forward)} takes more than one hidden-states tensor")
            raise PlanError(
                f"the plan runs each MLP in {plan.mlp_tiles} sequence tiles, but {name} "
                f"({type(mlp).__name__}) cannot be tiled: {why}; make the plan with mlp_tiles=1")


def _tiled(inner: Callable[[torch.Tensor], Any], block: str, plan_of: Callable[[], Optional[ElixirPlan]],
           name: str) -> Callable[[torch.Tensor], Any]:
    """``inner`` (the MLP's own forward) run over the sequence in the current plan's tiles."""
    def forward(hidden: torch.Tensor) -> Any:
        plan = plan_of()
        tiles = plan.mlp_tiles if plan is not None else 1
        if (tiles <= 1 or not isinstance(hidden, torch.Tensor) or hidden.dim() < 2
                or plan.policy_of(block) == "offload"):
            return inner(hidden)
        # always ``tiles`` of them (some empty when the sequence is shorter): every rank then
        # calls the MLP's modules as often, whatever its sequence length, and so fetches alike
        parts = torch.tensor_split(hidden, tiles, dim=-2)
        grad = torch.is_grad_enabled()
        outs = []
        for part in parts:
            out = checkpoint(inner, part, use_reentrant=False) if grad else inner(part)
            if not isinstance(out, torch.Tensor) or out.shape[:-1] != part.shape[:-1]:
                raise PlanError(
                    f"{name} returned {type(out).__name__} "
                    f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''} for a tile of shape "
                    f"{tuple(part.shape)}, not one tensor per token: it is not a position-wise MLP, so "
                    "it cannot run in tiles; make the plan with mlp_tiles=1")
            outs.append(out)
        return torch.cat(outs, dim=-2)

    return forward


@dataclass
class MlpTiles:
    """The MLPs this runtime tiles, and how to put their own forwards back.

    Attributes:
        tiled: MLP module name -> its block's name, for every MLP wrapped.
        note: why nothing is tiled where the plan asks for tiles ("" otherwise).
    """

    tiled: dict[str, str] = field(default_factory=dict)
    note: str = ""
    _own: dict[nn.Module, Optional[Any]] = field(default_factory=dict, repr=False)

    @classmethod
    def wire(cls, model: nn.Module, plan: ElixirPlan, owner: "weakref.ReferenceType[Any]") -> "MlpTiles":
        """Wrap each block's MLP when ``plan`` asks for tiles (``check_mlp_tiles`` passed);
        ``owner``: a weak reference to the object whose ``plan`` is current (the runtime),
        read at every call (the model's forwards must not keep the runtime alive)."""
        wiring = cls()
        if plan.mlp_tiles <= 1:
            return wiring
        mlps = find_mlps(model)
        if not mlps:
            wiring.note = (f"{type(model).__name__} has no MLP to tile (no decoder block, a subclass of "
                           f"Transformers' GradientCheckpointingLayer, with a child named one of {MLP_NAMES}); "
                           "its MLPs run whole")
            warnings.warn(f"hf_elixir: the plan asks for mlp_tiles={plan.mlp_tiles}, but {wiring.note}",
                          UserWarning, stacklevel=3)
            return wiring

        def plan_of() -> Optional[ElixirPlan]:
            live = owner()
            return live.plan if live is not None else None

        for name, (block, mlp) in mlps.items():
            wiring._own[mlp] = mlp.__dict__.get("forward")
            mlp.forward = _tiled(mlp.forward, block, plan_of, name)
            wiring.tiled[name] = block
        return wiring

    def restore(self) -> None:
        """Give every wrapped MLP its own forward back."""
        for mlp, own in self._own.items():
            if own is None:
                mlp.__dict__.pop("forward", None)
            else:
                mlp.forward = own
        self._own.clear()
        self.tiled = {}


__all__ = ["MLP_NAMES", "MlpTiles", "check_mlp_tiles", "find_mlps"]
