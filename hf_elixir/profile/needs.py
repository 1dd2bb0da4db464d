"""What a model needs from the runtime beyond its parameter list: the chunks each module
reads and the fewest rCache blocks that can hold every chunk in use at once.

Both come from one traced step on the meta device (``hf_elixir.profile``): which module's
forward reads which parameter, and the order in which the runtime pins and unpins each
module's chunks. The minimum depends on the model *and* the packing, so it is computed for
a plan's chunks, when the plan is built.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch import nn

from hf_elixir.profile.memory import run_step
from hf_elixir.profile.profiler import disable_checkpointing, enable_checkpointing
from hf_elixir.profile.trace import ExecutionTracer, build_meta_model, find_borrowed_reads, make_batch, set_training
from hf_elixir.profile.untouched import left_as_found


@dataclass
class FetchNeeds:
    """What ``trace_fetch_needs`` found.

    Attributes:
        module_params: module -> the chunked parameters (trainable and frozen) the runtime
            fetches for it (its own, a fetch unit's subtree, and the borrowed ones).
        borrowed: module -> parameters its forward reads without owning them.
        pins: the runtime's pin/unpin sequence (``Trace.pins``).
    """

    module_params: dict[str, list[str]]
    borrowed: dict[str, list[str]]
    pins: list[tuple[str, str]]

    def rcache_minimum(self, chunks: Sequence[Sequence[str]]) -> int:
        return rcache_minimum(self.pins, self.module_params, chunks)


def rcache_minimum(pins: Sequence[tuple[str, str]], module_params: Mapping[str, Sequence[str]],
                   chunks: Sequence[Sequence[str]]) -> int:
    """The fewest rCache blocks with which no fetch finds every block pinned.

    Replays the pin sequence: when a module is about to be fetched, the chunks already
    pinned and the chunks it needs must all hold a block at once. At least 1."""
    chunk_of = {name: i for i, params in enumerate(chunks) for name in params}
    needs = {m: tuple({chunk_of[p] for p in ps if p in chunk_of}) for m, ps in module_params.items()}
    pins_of: dict[int, int] = {}
    held: set[int] = set()  # the chunks pinned now (count above zero), kept as pins change
    most = 1
    for op, module in pins:
        cids = needs.get(module, ())
        if op == "pin":
            most = max(most, len(held) + sum(1 for c in cids if c not in held))
            for c in cids:
                n = pins_of[c] = pins_of.get(c, 0) + 1
                if n > 0:
                    held.add(c)
        else:
            for c in cids:
                n = pins_of[c] = pins_of.get(c, 0) - 1
                if n <= 0:
                    held.discard(c)
    return most


class RealStepWarning(UserWarning):
    """Planning ran one real step of the user's model because its meta copy could not run."""


#: the processes' ``RealStepWarning`` is given once: a model planned again costs the same
_warned: list[bool] = []


def trace_fetch_needs(model: nn.Module, example_batch: Any, fetch_units: Sequence[str],
                      checkpointing: bool) -> FetchNeeds:
    """Trace one step of a meta copy of ``model`` (never touching its memory) and return
    what it needs. Where the meta device cannot run the model, the real model runs one
    step instead, with a ``RealStepWarning`` (once per process) naming the meta error, and
    is left as it was found (``profile.untouched``): its user's hooks do not see the step."""
    try:
        with _nonzero_on_meta():
            return _trace(build_meta_model(model), example_batch, fetch_units, checkpointing)
    except Exception as exc:
        if any(p.is_meta for p in model.parameters()):
            raise
        meta_error = exc
    # Data-dependent shapes the meta device cannot follow (byte patching, ``.tolist()``):
    # trace the real model instead, once, and put back all the step changed.
    _warn_real_step(model, meta_error)
    with left_as_found(model):
        return _trace(model, example_batch, fetch_units, checkpointing)


def _warn_real_step(model: nn.Module, meta_error: Exception) -> None:
    """Say, once per process, that planning runs the real model and what that costs."""
    if _warned:
        return
    _warned.append(True)
    device = next(model.parameters()).device
    warnings.warn(
        f"hf_elixir could not trace {type(model).__name__} on the meta device "
        f"({type(meta_error).__name__}: {meta_error}), so planning runs one real forward and "
        f"backward of the model on a synthetic batch instead: one training step's time and "
        f"activation memory on {device}. The model is left as it was found (training flags, "
        "checkpointing, buffers, gradients, random state) and its own hooks do not see the step. "
        "A forward the meta device can run (nothing that reads its inputs on the host, such as .tolist()) avoids it.",
        RealStepWarning, stacklevel=3,
    )


@contextlib.contextmanager
def _nonzero_on_meta():
    """Let ``nonzero()`` run on meta tensors as if every element were non-zero: routing
    code (``(choice == e).nonzero()``) then sends every token to every expert, so the trace
    sees every module the model can run."""
    try:
        from torch.fx.experimental import _config as fx_config
    except ImportError:  # pragma: no cover - older torch: nonzero on meta just raises
        yield
        return
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


def _trace(meta: nn.Module, example_batch: Any, fetch_units: Sequence[str], checkpointing: bool) -> FetchNeeds:
    """One traced step of ``meta`` (a meta copy, or the real model as a fallback)."""
    was_training = meta.training
    set_training(meta)
    vocab = getattr(getattr(meta, "config", None), "vocab_size", None)
    device = next(meta.parameters()).device
    batch = make_batch(example_batch, vocab, device=device)
    borrowed = find_borrowed_reads(meta, batch, fetch_units)
    tracer = ExecutionTracer(meta, fetch_units, borrowed)
    if checkpointing:
        enable_checkpointing(meta)

    def backward_begins() -> None:
        tracer.in_backward = True

    try:
        with tracer:
            run_step(meta, batch, on_backward_start=backward_begins)
    finally:
        if checkpointing:
            disable_checkpointing(meta)
        set_training(meta, was_training)
    return FetchNeeds(tracer.trace.module_params, borrowed, tracer.trace.pins)
