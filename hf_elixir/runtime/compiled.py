"""torch.compile under the chunk runtime: each repeated block compiled once, hooks outside.

A user asks for compile in several ways (the Trainer's ``torch_compile``, Accelerate's
``dynamo_backend``, the ``elixir:`` section's ``compile``, ``ElixirModule(compile=...)``);
they all end here as ``CompileOptions``. What is compiled is what runs between two fetch
points: the forward of each repeated block (the children of a ``ModuleList`` that all share
one class, a decoder layer), with one compiled code shared by all blocks of one shape, as
Accelerate's regional compilation does.

Why only the block's ``forward`` and not ``module.compile()`` or ``torch.compile(model)``:
those compile ``nn.Module.__call__`` with its hooks, and the runtime's hooks gather and
release chunks, prefetch, and hand gradients to the reducer, which are collectives and
Python bookkeeping that must run eagerly, every call. So a compiled block is made one fetch
unit (``ElixirModule._fetch_units``): its hooks sit on the block, gather every chunk the
block reads before its forward and after its backward begins, and run in ``__call__``,
outside the compiled ``forward``. Inside, no submodule has a hook, and every parameter is
a plain gathered tensor. With ``inline_inbuilt_nn_modules`` (torch's default) parameters
are inputs of the compiled graph, guarded by shape, stride and dtype only, so a block does
not recompile when its chunk moves between the shard, the rCache and the host.

Where compile cannot apply, ``RegionalCompile.prepare`` says why in one warning and the
model runs eager: no repeated blocks, a block whose chunks the rCache cannot hold at once, a
backend torch does not have. A mode that records CUDA graphs (``reduce-overhead``,
``max-autotune``) needs fixed input addresses, which gathered parameters do not have; the
nearest mode without CUDA graphs is used instead, with a warning.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from hf_elixir.planner.record import ElixirPlan
from hf_elixir.vocab import HfElixirError

#: modes that record CUDA graphs, and the mode that does the same without them
NO_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OFF_WORDS = ("", "no", "none", "off", "false", "0")
ON_WORDS = ("on", "true", "yes", "1")


class CompileError(HfElixirError, ValueError):
    """A compile request that names something torch does not have (a backend, a mode)."""


class CompileWarning(UserWarning):
    """Compile was asked for and could not apply (or not as asked): the run says why."""


@dataclass(frozen=True)
class CompileOptions:
    """``torch.compile``'s options, as every way of asking for compile gives them."""

    backend: Union[str, Callable] = "inductor"
    mode: Optional[str] = None
    fullgraph: bool = False
    dynamic: Optional[bool] = None
    options: Optional[Mapping[str, Any]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.backend, str):
            name = self.backend.strip().lower()
            known = torch._dynamo.list_backends(exclude_tags=())
            if name not in known:
                raise CompileError(f"compile backend {self.backend!r} is not one torch has; "
                                   f"use one of: {', '.join(sorted(known))}")
            object.__setattr__(self, "backend", name)
        elif not callable(self.backend):
            raise CompileError(f"compile backend must be a name or a callable, got {type(self.backend).__name__}")
        if self.mode is not None and self.mode not in MODES:
            raise CompileError(f"compile mode {self.mode!r} is not one of {', '.join(MODES)}")

    @classmethod
    def parse(cls, value: Any) -> Optional["CompileOptions"]:
        """None for "no compile"; True or an on-word for inductor; a backend name; a dict
        of ``torch.compile`` keywords; or CompileOptions as they are."""
        if value is None or value is False or isinstance(value, CompileOptions):
            return value or None
        if value is True:
            return cls()
        if isinstance(value, str):
            word = value.strip().lower()
            if word in OFF_WORDS:
                return None
            return cls() if word in ON_WORDS else cls(backend=word)
        if isinstance(value, Mapping):
            unknown = set(value) - {"backend", "mode", "fullgraph", "dynamic", "options"}
            if unknown:
                raise CompileError(f"unknown compile option(s) {sorted(unknown)}; the options are backend, "
                                   "mode, fullgraph, dynamic, options")
            return cls(**value)
        raise CompileError(f"compile takes true/false, a backend name or a dict of torch.compile options, "
                           f"got {value!r}")

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.options:
            out["options"] = dict(self.options)
        return out

    def describe(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")
        return f"backend {backend}" + (f", mode {self.mode}" if self.mode else "")


def _watch_first_call(compiled: Callable, name: str) -> Callable:
    """``compiled``, whose first call warns when dynamo broke the block's graph (a part of
    it then runs eager, or all of it: the request must not fade without a word)."""
    from torch._dynamo.utils import counters

    first = [True]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not first[0]:
            return compiled(*args, **kwargs)
        first[0] = False
        before = dict(counters["graph_break"])
        out = compiled(*args, **kwargs)
        new = [reason for reason, n in counters["graph_break"].items() if n > before.get(reason, 0)]
        if new:
            warnings.warn(f"hf_elixir: torch.compile broke the graph of block {name!r} ({'; '.join(new)[:400]}); "
                          "the parts between the breaks are compiled, the rest runs eager "
                          "(TORCH_LOGS=graph_breaks shows where)", CompileWarning, stacklevel=2)
        return out

    return forward


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each child of a ``ModuleList`` whose children all share one class
    and hold parameters (a model's decoder layers), outermost lists only: a list inside a
    block (experts) is compiled with its block."""
    found: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if any(name == b or name.startswith(b + ".") for b, _ in found):
            continue
        kinds = {type(child) for child in mod}
        if len(kinds) == 1 and next(iter(kinds)) is not nn.ModuleList and any(True for _ in mod.parameters()):
            found.extend((f"{name}.{i}" if name else str(i), child) for i, child in enumerate(mod))
    return found


@dataclass
class RegionalCompile:
    """Which blocks a runtime compiles, and why none are when none are (``reason``)."""

    options: Optional[CompileOptions]
    blocks: list[tuple[str, nn.Module]] = field(default_factory=list)
    reason: Optional[str] = None
    #: the most chunks one compiled block reads: the rCache must hold them all at once
    need: int = 0
    _applied: list[nn.Module] = field(default_factory=list)

    @classmethod
    def prepare(cls, model: nn.Module, options: Optional[CompileOptions], plan: ElixirPlan) -> "RegionalCompile":
        """Decide, before the model is changed, what to compile: a block fetched whole must
        find all the chunks it reads (its own and those it borrows) in the rCache at once."""
        if options is None:
            return cls(None)
        if options.mode in NO_CUDA_GRAPHS:
            substitute = NO_CUDA_GRAPHS[options.mode]
            warnings.warn(
                f"hf_elixir: compile mode {options.mode!r} records CUDA graphs, which need every input at a "
                "fixed address, and a gathered parameter's address changes from step to step; the blocks "
                f"are compiled with mode {substitute!r} instead (the same, without CUDA graphs)",
                CompileWarning, stacklevel=3)
            options = CompileOptions(options.backend, substitute, options.fullgraph, options.dynamic, options.options)
        blocks = repeated_blocks(model)
        if not blocks:
            return cls._eager(options, f"{type(model).__name__} has no repeated blocks (a ModuleList of "
                                       "one layer class) to compile one at a time")
        chunk_of = {name: cid for cid, c in enumerate(plan.chunks) for name in c.params}

        def chunks_read(block_name: str) -> int:
            inside = lambda name: name.startswith(block_name + ".")
            names = [n for n in chunk_of if inside(n)]
            names += [n for mod, read in plan.borrowed.items() if mod == block_name or inside(mod) for n in read]
            return len({chunk_of[n] for n in names if n in chunk_of})

        widest = max((b[0] for b in blocks), key=chunks_read)
        need, rcache_blocks = chunks_read(widest), plan.rcache_blocks
        if need > rcache_blocks:
            return cls._eager(options, f"block {widest!r} reads {need} chunks, and a compiled block needs "
                                       f"all of them gathered at once, but the plan's rCache holds "
                                       f"{rcache_blocks}; plan with rcache_blocks >= {need} or a larger "
                                       "chunk size to compile")
        return cls(options, blocks, need=need)

    def fit(self, plan: ElixirPlan) -> ElixirPlan:
        """``plan`` (a re-plan after running out of memory), with an rCache that still holds
        a compiled block's chunks: a block is fetched whole, and fewer blocks would fail its
        fetch. The compiled code itself depends on shapes only, so it stays valid."""
        if not self.active or plan.rcache_blocks >= self.need:
            return plan
        warnings.warn(f"hf_elixir: the new plan's rCache of {plan.rcache_blocks} block(s) cannot hold a compiled "
                      f"block's {self.need} chunks, which are gathered together; it keeps {self.need}",
                      CompileWarning, stacklevel=3)
        return dataclasses.replace(plan, rcache_blocks=self.need)

    @classmethod
    def _eager(cls, options: CompileOptions, why: str) -> "RegionalCompile":
        warnings.warn(f"hf_elixir: torch.compile was asked for ({options.describe()}) but cannot apply: {why}. "
                      "The model runs eager.", CompileWarning, stacklevel=4)
        return cls(options, [], why)

    @property
    def active(self) -> bool:
        return bool(self.blocks)

    @property
    def unit_names(self) -> list[str]:
        """The blocks' names: each is fetched whole (one fetch unit)."""
        return [name for name, _ in self.blocks]

    def apply(self) -> None:
        """Compile each block's forward (its ``__call__`` and hooks stay eager). Blocks of one
        class share one code object, so their siblings reuse the first one's compiled code.

        A block that checkpoints inside its forward (Transformers' checkpointing layers do)
        is traced through the checkpoint; a context variable a hub kernel sets in the
        forward made dynamo give the whole block up, silently. Skipping such side effects in
        the recomputation is what Accelerate's regional compilation sets too."""
        if not self.active or self._applied:
            return
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        kwargs = self.options.kwargs()
        for i, (name, block) in enumerate(self.blocks):
            compiled = torch.compile(block.forward, **kwargs)
            block.forward = _watch_first_call(compiled, name) if i == 0 else compiled
            self._applied.append(block)

    def remove(self) -> None:
        """Give each block its own forward back."""
        for block in self._applied:
            block.__dict__.pop("forward", None)
        self._applied.clear()

    def describe(self) -> str:
        if self.options is None:
            return "compile: off"
        if not self.active:
            return f"compile: asked for, running eager ({self.reason})"
        kinds = sorted({type(b).__name__ for _, b in self.blocks})
        return (f"compile: {len(self.blocks)} block(s) ({', '.join(kinds)}) compiled one at a time, "
                f"{self.options.describe()}; embeddings, head and loss eager")
