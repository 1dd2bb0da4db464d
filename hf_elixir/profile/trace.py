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
import gc
import types
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_elixir.profile.grad_marks import alias_inputs, on_output_grad
from hf_elixir.profile.params import detect_fetch_units, is_packed
from hf_elixir.profile.user_hooks import drop_user_hooks
from hf_elixir.vocab import torch_dtype as _torch_dtype
from hf_elixir.profile.memory import LiveStorageTracker

Phase = str  # "forward" | "backward" | "recompute"


# ---------------------------------------------------------------------- meta models
def set_training(module: nn.Module, mode: bool = True) -> nn.Module:
    """Set ``training`` on ``module`` and every submodule, as ``nn.Module.train`` does, but
    without calling any subclass's own ``train``.

    A profile needs only the flags (dropout, checkpointing and the loss read them). A
    Transformers model's ``train`` also re-kernelizes it when hub kernels are on, which
    ``from_pretrained`` turns on whenever the ``kernels`` package is installed (Transformers 5),
    and kernelizing a meta copy fails ("Unsupported device type 'meta'").
    """
    for m in module.modules():
        m.training = mode
    return module


def _meta_packed(p: nn.Parameter) -> nn.Parameter:
    """A meta copy of a packed 4-bit weight: its own class and dtype (its bytes are what a
    chunk holds, ``params.chunk_numel``) and its attributes, the quantisation state
    included, which the layer's kernel reads (its meta implementation needs only shapes)."""
    meta = torch.Tensor._make_subclass(type(p), torch.empty_like(p, device="meta"), p.requires_grad)
    meta.__dict__.update(p.__dict__)
    if "module" in meta.__dict__:
        meta.module = None  # the real layer: the copy must not reach it
    return meta


def rebind_patched_forwards(original: nn.Module, copied: nn.Module, memo: dict[int, Any]) -> None:
    """After ``copied = copy.deepcopy(original, memo)``: make a forward patched onto a module
    instance run the copy, not the original model.

    A wrapper set as ``module.forward = MethodType(wrapper, module)`` (TRL's fused LM head,
    which every SFTTrainer adds) closes over the module's original bound ``forward``.
    ``deepcopy`` rebinds the method to the copy but shares the function, closure and all, so
    the copy's forward would run the original model (for a meta copy: the real model on meta
    inputs, whose modules' hooks never fire and whose first op mixing a real output with a
    meta tensor fails). Such a wrapper is rebuilt over a deep copy of its closure, through the
    same memo, so what it closed over from the original (its bound forward, its modules) is
    the copy's."""
    twins = dict(copied.named_modules())
    for name, orig in original.named_modules():
        twin = twins.get(name)
        patched = orig.__dict__.get("forward")
        if twin is None:
            continue
        if not isinstance(patched, types.MethodType) or not patched.__func__.__closure__:
            continue
        func = patched.__func__
        cells = []
        for cell in func.__closure__:
            try:
                cells.append(types.CellType(copy.deepcopy(cell.cell_contents, memo)))
            except ValueError:  # an empty cell
                cells.append(types.CellType())
        rebuilt = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, tuple(cells))
        rebuilt.__kwdefaults__ = func.__kwdefaults__
        rebuilt.__dict__.update(func.__dict__)
        twin.forward = types.MethodType(rebuilt, twin)


def build_meta_model(model_or_config: Any, dtype: str | torch.dtype = "float32",
                     leave_out: Iterable[nn.Module] = ()) -> nn.Module:
    """A copy of the model whose parameters and buffers live on the meta device.

    Accepts a ``transformers`` config (the model is built with ``AutoModelForCausalLM`` under
    ``torch.device("meta")``: no weights are read or allocated) or an ``nn.Module`` (deep-copied
    with every parameter and buffer replaced by a meta tensor of the same shape, so even a real
    model is never duplicated in memory; tied parameters stay tied). Floating-point parameters
    take the compute ``dtype``, as the runtime casts them; packed 4-bit weights keep theirs.
    The copy keeps the hooks libraries registered and none of the user's
    (``profile.user_hooks``). Submodules in ``leave_out`` are not copied: their places in
    the copy hold None (the caller removes them; ``profile.fold`` copies a few layers of a
    deep model).
    """
    torch_dtype = _torch_dtype(dtype)
    if isinstance(model_or_config, nn.Module):
        memo: dict[int, Any] = {}
        for p in model_or_config.parameters():
            if is_packed(p):
                memo[id(p)] = _meta_packed(p)
                continue
            memo[id(p)] = nn.Parameter(
                torch.empty_like(p, device="meta", dtype=torch_dtype if p.is_floating_point() else p.dtype),
                requires_grad=p.requires_grad,
            )
        for b in model_or_config.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
        for m in leave_out:
            memo[id(m)] = None
        meta = copy.deepcopy(model_or_config, memo)
        rebind_patched_forwards(model_or_config, meta, memo)
        set_training(meta, model_or_config.training)
        return drop_user_hooks(meta)  # a hook counting or logging calls must not see planning
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if not isinstance(model_or_config, PretrainedConfig):
        raise TypeError(
            f"expected an nn.Module or a transformers config, got {type(model_or_config).__name__}"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_or_config, dtype=torch_dtype)
    return model


def own_meta_model(model: nn.Module, dtype: str | torch.dtype) -> nn.Module:
    """A model the caller built on the meta device for profiling (and so owns), with its
    floating-point parameters in the compute dtype as ``build_meta_model`` would give them,
    cast in place rather than copied; any other model is copied by ``build_meta_model``."""
    if not all(p.is_meta for p in model.parameters()):
        return build_meta_model(model, dtype)
    torch_dtype = _torch_dtype(dtype)
    cast: dict[int, nn.Parameter] = {}  # tied parameters stay one parameter
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or is_packed(p) or not p.is_floating_point() or p.dtype == torch_dtype:
                continue
            if id(p) not in cast:
                cast[id(p)] = nn.Parameter(torch.empty_like(p, dtype=torch_dtype), requires_grad=p.requires_grad)
            module._parameters[name] = cast[id(p)]
    return model


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


def module_parameters(model: nn.Module, fetch_units: Iterable[str] = (),
                      borrowed: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Module name -> canonical names of the parameters the runtime fetches for it (every
    chunked parameter: trainable ones and frozen ones, see ``plan.chunked_parameters``).

    A module owns its direct parameters; a fetch unit owns its whole subtree and its
    descendants own nothing; ``borrowed`` (see ``find_borrowed_reads``) adds parameters a
    module's forward reads without owning them. Modules fetching nothing are left out.
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
            if (p.is_floating_point() or is_packed(p)) and names[id(p)] not in own:
                own.append(names[id(p)])
        own += [p for p in (borrowed or {}).get(mname, []) if p not in own]
        if own and mname not in owned:
            owned[mname] = own
    return owned


class _ReadRecorder(TorchDispatchMode):
    """Sees every operator in forward and notes parameter storages read by a module that
    does not fetch them (a parent reading ``self.child.weight``, a router calling
    ``F.linear(h, self.gate.weight)``, or a view of a weight kept from an earlier module)."""

    def __init__(self, storages: dict[int, str], fetched: dict[str, list[str]], unit_of: dict[str, str]):
        super().__init__()
        self.storages = storages
        self.fetched = {m: set(ps) for m, ps in fetched.items()}
        self.unit_of = unit_of
        self.stack: list[str] = []
        self.reads: dict[str, list[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.stack:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    name = self.storages.get(_storage_id(t))
                    if name is not None:
                        self._note(name)
        return func(*args, **kwargs)

    def _note(self, param: str) -> None:
        units = [self.unit_of[m] for m in self.stack]
        if any(param in self.fetched.get(u, ()) for u in units):
            return  # a module in the call stack fetched it: it is gathered and pinned
        reads = self.reads.setdefault(units[-1], [])
        if param not in reads:
            reads.append(param)


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # tensors without storage (sparse, nested, functional wrappers)
        return None


def find_borrowed_reads(model: nn.Module, batch: dict[str, torch.Tensor],
                        fetch_units: Iterable[str] = ()) -> dict[str, list[str]]:
    """Module name -> chunked parameters its forward reads but the runtime would not fetch
    for it, found by running one forward of ``model`` (a meta copy, normally)."""
    units = list(fetch_units)
    names = parameter_names(model)
    storages = {_storage_id(p): names[id(p)] for p in model.parameters() if p.is_floating_point() or is_packed(p)}
    unit_of = {}
    for mname, _ in model.named_modules():
        unit_of[mname] = next((u for u in units if mname == u or mname.startswith(u + ".")), mname)
    recorder = _ReadRecorder(storages, module_parameters(model, units), unit_of)
    def enter(name: str):
        return lambda mod, args: recorder.stack.append(name)

    def leave(mod, args, out) -> None:
        recorder.stack.pop()

    handles = []
    for mname, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(mname)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with LiveStorageTracker(count_flops=False), recorder:
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return recorder.reads


# ---------------------------------------------------------------------- tracing
@dataclass
class EventWork:
    """The operators run between one fetch event and the next: what the cost model prices.

    Matmul-like operators (those PyTorch has FLOP formulas for) are kept by layout and size,
    because a small matmul runs far below a large one's rate and layouts differ:
    ``matmul[(layout, b)]`` is the total FLOPs of the operators of that layout (see
    ``profile.memory.matmul_layout``) whose own FLOPs lie in ``[2**b, 2**(b+1))``. Other operators are priced by the
    bytes they read or rewrite in place (``read``), every operator by the newly allocated
    outputs it writes, kept by size like matmuls (``fresh[b]``: outputs of ``[2**b, 2**(b+1))``
    bytes; a large fresh output pays page faults on a CPU), plus a fixed cost per call.
    """

    matmul: dict[tuple[str, int], float] = field(default_factory=dict)
    read: float = 0.0
    strided: float = 0.0  # bytes element-wise operators read against their layout
    special: float = 0.0  # output elements of arithmetic-bound operators (``TRANSCENDENTAL``)
    fresh: dict[int, float] = field(default_factory=dict)
    ops: int = 0

    def add(self, flops: int, read: int, fresh: Iterable[int] = (), layout: str = "", strided: int = 0,
            special: int = 0) -> None:
        self.ops += 1
        self.strided += strided
        self.special += special
        if flops > 0:
            key = (layout, int(flops).bit_length() - 1)
            self.matmul[key] = self.matmul.get(key, 0.0) + flops
        self.read += read
        for nbytes in fresh:
            b = int(nbytes).bit_length() - 1
            self.fresh[b] = self.fresh.get(b, 0.0) + nbytes

    def merge(self, other: "EventWork") -> None:
        for b, f in other.matmul.items():
            self.matmul[b] = self.matmul.get(b, 0.0) + f
        for b, f in other.fresh.items():
            self.fresh[b] = self.fresh.get(b, 0.0) + f
        self.read += other.read
        self.strided += other.strided
        self.special += other.special
        self.ops += other.ops

    @property
    def flops(self) -> float:
        return sum(self.matmul.values())

    @property
    def bytes(self) -> float:
        """Everything moved outside matmul arithmetic: read, rewritten and freshly written."""
        return self.read + self.strided + sum(self.fresh.values())


@dataclass
class Trace:
    """What the runtime will fetch, in order.

    Attributes:
        events: ``(phase, module)`` in execution order, phase one of forward, backward, recompute.
        module_params: module -> canonical names of the trainable parameters it uses.
        module_flops: module -> forward matmul FLOPs of the operators run while it was the
            innermost module owning parameters (used to spread compute time over modules).
        pins: ``("pin" | "unpin", module)`` in the order the runtime pins and unpins each
            module's chunks, forward and backward (see ``ExecutionTracer``).
        work: one ``EventWork`` per event: the operators that ran from that event until the
            next (the compute between two fetch points; what ran before the first event
            counts for the first).
        live: per event, the activation and temporary bytes alive when it began and the
            most alive until the next event (the memory model lines these up with the
            gradient buffers and gathered chunks of the same instant).
    """

    events: list[tuple[Phase, str]] = field(default_factory=list)
    module_params: dict[str, list[str]] = field(default_factory=dict)
    module_flops: dict[str, int] = field(default_factory=dict)
    pins: list[tuple[str, str]] = field(default_factory=list)
    work: list[EventWork] = field(default_factory=list)
    live: list[tuple[int, int]] = field(default_factory=list)
    #: per pin, how many events had begun when it was made (``profile.fold`` cuts the pins
    #: where it cuts the events)
    pin_events: list[int] = field(default_factory=list)

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


@dataclass
class _Call:
    """One traced call of one fetch unit, followed through its backward (as the runtime does)."""

    name: str
    recomputed: bool  # called again in backward (activation checkpointing)
    pinned: bool = False
    done: bool = False


class ExecutionTracer:
    """Module hooks that fill a ``Trace`` while the model runs one step.

    Besides the fetch order it records when each fetch unit's chunks are pinned and
    unpinned, with exactly the runtime's rules (``hf_elixir.profile.grad_marks``): pinned from
    pre-forward to post-forward, and in backward from its outputs' first gradient until the
    gradients of its inputs are complete. ``Trace.pins`` is what ``rcache_minimum`` replays.
    """

    def __init__(self, model: nn.Module, fetch_units: Iterable[str] | None = None,
                 borrowed: dict[str, list[str]] | None = None):
        self.model = model
        self.fetch_units = list(detect_fetch_units(model) if fetch_units is None else fetch_units)
        self.trace = Trace(module_params=module_parameters(model, self.fetch_units, borrowed))
        self.in_backward = False
        self._stack: list[str] = []
        self._calls: dict[str, list[_Call]] = {}
        self._handles: list[Any] = []
        self._pending = EventWork()  # operators seen before the first event
        self.tracker: LiveStorageTracker | None = None  # set by trace_step: live bytes per event
        #: collect young reference cycles at every event (``trace_step`` pauses the collector,
        #: so that garbage dies at the same instants every run, and as soon as a real run's would)
        self.collect = False

    def __enter__(self) -> "ExecutionTracer":
        for name, module in self.model.named_modules():
            if name not in self.trace.module_params:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(name), always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def add_flops(self, n: int) -> None:
        if self._stack and not self.in_backward:
            top = self._stack[-1]
            self.trace.module_flops[top] = self.trace.module_flops.get(top, 0) + n

    def add_op(self, flops: int, read: int, fresh: list[int], layout: str = "", strided: int = 0,
               special: int = 0) -> None:
        """Charge one operator to the event that runs now."""
        (self.trace.work[-1] if self.trace.work else self._pending).add(flops, read, fresh, layout, strided, special)
        if self.tracker is not None and self.trace.live:
            at, top = self.trace.live[-1]
            if self.tracker.current > top:
                self.trace.live[-1] = (at, self.tracker.current)

    def _event(self, phase: Phase, name: str) -> None:
        if self.collect:
            gc.collect(0)
        self.trace.events.append((phase, name))
        work = EventWork()
        if not self.trace.work:
            work.merge(self._pending)
        self.trace.work.append(work)
        now = self.tracker.current if self.tracker is not None else 0
        self.trace.live.append((now, now))

    def _pin(self, kind: str, name: str) -> None:
        self.trace.pins.append((kind, name))
        self.trace.pin_events.append(len(self.trace.events))

    def _pre_hook(self, name: str):
        def hook(module, args, kwargs):
            self._event("recompute" if self.in_backward else "forward", name)
            self._pin("pin", name)
            self._stack.append(name)
            call = _Call(name, recomputed=self.in_backward)
            self._calls.setdefault(name, []).append(call)
            if torch.is_grad_enabled():
                return alias_inputs((args, kwargs), lambda: self._backward_done(call))
            return None

        return hook

    def _post_hook(self, name: str):
        def hook(module, args, output):
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            self._pin("unpin", name)
            call = self._calls[name].pop()
            if torch.is_grad_enabled():
                on_output_grad(output, lambda: self._backward_begins(call))
            return None

        return hook

    def _backward_begins(self, call: _Call) -> None:
        if call.pinned:
            return
        call.pinned = True
        if not call.recomputed:  # a recomputed call's fetch event was its recompute
            self._event("backward", call.name)
        self._pin("pin", call.name)

    def _backward_done(self, call: _Call) -> None:
        if call.pinned and not call.done:
            call.done = True
            self._pin("unpin", call.name)


def _tensors(obj: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    if hasattr(obj, "to_tuple"):
        obj = obj.to_tuple()
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
