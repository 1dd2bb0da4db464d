"""A model prepared before its batch shape is known, sharded on its first forward.

The planner prices a plan for one (batch size, sequence length). A script whose loader
cannot tell it at ``prepare`` (the model prepared before, or without, any DataLoader;
batches drawn from a generator; an iterable dataset) still runs: ``prepare`` returns a
``LazyElixirModule``, which holds the whole model untouched, exactly as it was handed in,
until its first forward. That call plans from its real inputs (agreed over the ranks, which
may pad differently), shards the model and goes on as an ordinary ElixirModule; FSDP
initialises lazily on its first forward in the same way.

It is an ElixirModule (``isinstance`` holds), so the accelerator and the Trainer treat it as
one; before the first forward the parts that need chunks say so instead of failing with an
AttributeError on the wrapped model, and what can be answered from the whole model
(parameters, ``state_dict``, ``zero_grad``) is.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Collection, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from hf_elixir.integrations.planning import batch_shape_from_inputs
from hf_elixir.planner.record import ElixirPlan
from hf_elixir.runtime import ElixirModule
from hf_elixir.vocab import HfElixirError

# attributes ElixirModule.__init__ creates; read before the first forward they get a clear error
_RUNTIME_ATTRIBUTES = frozenset({
    "plan", "comm", "chunks", "slots", "slot_by_name", "cache", "fetcher", "reducer", "hooks", "ledger",
    "dtype", "heap_guard", "copy_stream",
})


class NotShardedYetError(HfElixirError, RuntimeError, AttributeError):
    """The model plans on its first forward and has not run one. An AttributeError too, so
    ``getattr(model, "plan", None)`` and ``hasattr`` answer as for an attribute not there yet."""


class LazyElixirModule(ElixirModule):
    """An ElixirModule whose construction waits for the first forward's inputs.

    Args:
        model: the user's model (left as it is until the first forward).
        make_plan: called with (batch size, sequence length) of the first forward, returns the
            plan; every rank calls it with the same shape.
        device: the compute device.
        on_shard: called with this module once it is sharded, before that forward runs (the
            accelerator wraps the optimizers prepared beside it and applies a pending
            ``load_state`` there).
        recover_oom, nvme_path, compile: as for ElixirModule.
    """

    def __init__(self, model: nn.Module, make_plan: Callable[[tuple[int, int]], ElixirPlan],
                 device: torch.device, on_shard: Callable[["LazyElixirModule"], None],
                 recover_oom: bool = True, nvme_path: Optional[str] = None, compile: Any = None) -> None:
        nn.Module.__init__(self)
        self.module = model
        self.__dict__["_lazy"] = {"make_plan": make_plan, "device": device, "on_shard": on_shard,
                                  "recover_oom": recover_oom, "nvme_path": nvme_path, "compile": compile}

    @property
    def sharded(self) -> bool:
        return "_lazy" not in self.__dict__

    def __getattr__(self, name: str) -> Any:
        if name in _RUNTIME_ATTRIBUTES and "_lazy" in self.__dict__:
            raise NotShardedYetError(
                f"hf_elixir has not sharded this model yet, so it has no {name!r}: no training batch "
                "shape was known when it was prepared (no DataLoader prepared with it gave one), so it "
                "is planned and sharded on its first forward. Run a forward first, or set the "
                "batch_size and seq_len elixir options to shard it at prepare")
        return super().__getattr__(name)

    # ------------------------------------------------------------------ sharding
    def shard(self, shape: Optional[tuple[int, int]], what: str = "its first forward") -> None:
        """Plan for ``shape`` and shard the model now (collective: every rank at once).

        Ranks may see different shapes (dynamic padding, uneven generators); the largest on
        any rank is planned for, so that every rank makes the same plan."""
        lazy = self.__dict__["_lazy"]
        device = lazy["device"]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor(list(shape) if shape else [0, 0], dtype=torch.int64,
                                  device=device if device.type == "cuda" else "cpu")
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            shape = tuple(int(v) for v in agreed.tolist()) if int(agreed.min()) > 0 else None
            if shape is None:
                raise ValueError(self._no_shape_message(what))
        elif shape is None:
            raise ValueError(self._no_shape_message(what))
        plan = lazy["make_plan"](shape)
        training = self.training
        hooks = {k: v for k, v in self.__dict__.items() if k.startswith("_") and "hook" in k}
        del self.__dict__["_lazy"]
        try:
            ElixirModule.__init__(self, self._modules["module"], plan, device=device,
                                  recover_oom=lazy["recover_oom"], nvme_path=lazy["nvme_path"],
                                  compile=lazy["compile"])
        except BaseException:
            self.__dict__["_lazy"] = lazy
            raise
        self.__dict__.update(hooks)  # nn.Module.__init__ cleared hooks registered on the wrapper
        self.training = training
        lazy["on_shard"](self)

    @staticmethod
    def _no_shape_message(what: str) -> str:
        return (
            f"hf_elixir plans for the shape of a training batch; none was known at prepare (no "
            f"DataLoader prepared with the model gave one) and {what} on some rank had no 2-D token "
            "tensor (input_ids, inputs_embeds or a positional (batch, sequence) integer tensor). Set "
            "the batch_size and seq_len elixir options")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.sharded:
            self.shard(batch_shape_from_inputs(args, kwargs))
        return super().forward(*args, **kwargs)

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if not self.sharded:
            self.shard(batch_shape_from_inputs(args, kwargs), "the first generate() call")
        return super().generate(*args, **kwargs)

    # ------------------------------------------------------------------ before the first forward
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.sharded:
            return super().zero_grad(set_to_none=set_to_none)
        self.module.zero_grad(set_to_none=set_to_none)

    def drain(self) -> None:
        if self.sharded:
            super().drain()

    def close(self) -> None:
        """Nothing was made before the first forward, so there is nothing to close."""
        if self.sharded:
            super().close()

    def release_all(self, keep: Collection[int] = ()) -> None:
        if self.sharded:
            super().release_all(keep=keep)

    @contextlib.contextmanager
    def gathered_parameters(self, *params: Any) -> Iterator[None]:
        if self.sharded:
            with super().gathered_parameters(*params):
                yield
        else:
            yield  # the parameters are whole and readable on every rank

    def prefetch_next_pass(self) -> None:
        if self.sharded:
            super().prefetch_next_pass()

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Before sharding: the whole model's own tensors, copied to the CPU like the sharded
        state_dict's."""
        if self.sharded:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        out = {} if destination is None else destination
        for key, value in self.module.state_dict(keep_vars=True).items():
            out[prefix + key] = value.detach().cpu().clone()
        return out

    def trainable_state_dict(self, prefix: str = "") -> dict:
        if self.sharded:
            return super().trainable_state_dict(prefix)
        trainable = {id(p) for p in self.module.parameters() if p.requires_grad}
        return {prefix + k: v.detach().cpu().clone()
                for k, v in self.module.state_dict(keep_vars=True).items() if id(v) in trainable}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Before sharding the values go into the whole model, which the sharding copies."""
        if self.sharded:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
