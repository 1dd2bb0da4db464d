"""Module and parameter hooks: fetch before forward and backward, unpin after, hand off grads.

For a module that owns chunked parameters:
- pre-forward: fetch (gather and pin) its chunks; hand it aliases of its grad-requiring
  inputs whose gradient hook tells us when its backward is done;
- post-forward: unpin; hook its grad-requiring outputs so its chunks are fetched again
  before autograd runs its backward (see ``hf_elixir.profile.grad_marks``: the model may modify
  both in place);
- each chunked parameter's post-accumulate-grad hook hands the gradient to the reducer
  (or, where the parameter's ``.grad`` is its place in the gradient shard, notes it).
At the end of every backward (an autograd engine callback) leftover pins are dropped and
the remaining chunks are reduce-scattered. When every chunk is gathered in place (one rank,
shards on the compute device: ``lean``), the input aliases and output hooks are not made,
since no chunk can be evicted before its backward; the first module outputs that need a
gradient in each forward queue the end-of-backward callback. When, besides, no optimizer
step releases a chunk (``resident``: plain PyTorch's case, everything fits on one device),
the per-module hooks are not installed at all: the root's pre-forward gathers whatever a
load released, and the model's non-scalar outputs queue the end-of-backward callback.

Reads that no module hook sees (a fused loss reading ``lm_head.weight`` directly, a custom
autograd function) reach ``read_released`` through the released parameter itself
(``released.py``). Inside a forward or a backward of the model every rank runs the same
code, so the chunk is gathered there and *held* (pinned) until the backward that follows is
over, or until the forward ends when no graph is being built: autograd may have saved a
view of the weight, which must still hold the gathered values when its backward runs.
FSDP2 keeps its root's parameters gathered from forward to backward for the same reason.
Everywhere else a read raises: a gather there is a collective that may run on one rank only.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from hf_elixir.profile.grad_marks import alias_inputs, grad_tensors, on_output_grad
from hf_elixir.runtime.cache import RCache
from hf_elixir.runtime.chunk import Chunk, ChunkState, Slot
from hf_elixir.runtime.fetch import Fetcher
from hf_elixir.runtime.reduce import GradReducer
from hf_elixir.runtime.released import ReleasedParameterError, attach_reader, detach_reader, released_read_error


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Call:
    """One forward call of one fetch unit, followed through its backward."""

    cids: list[int]
    fetched: bool = False   # forward fetch succeeded (its pins are held until post-forward)
    pinned: bool = False
    done: bool = False


@dataclass
class HookManager:
    root: nn.Module
    units: dict[nn.Module, list[int]]
    slots: Sequence[Slot]
    slot_chunk: Sequence[Chunk]
    fetcher: Fetcher
    reducer: GradReducer
    cache: RCache
    handles: list = field(default_factory=list)
    _open_calls: list[_Call] = field(default_factory=list)
    _callback_queued: bool = False
    _forward_depth: int = 0        # forwards of the root or of a fetch unit now running
    _gathering_context: int = 0    # ElixirModule.gathered_parameters() blocks now open
    holds: list[int] = field(default_factory=list)  # chunks pinned for reads outside modules
    #: raises an injected out-of-memory error when one is due (runtime/faults.py); None: none
    fault_check: Optional[Callable[[str], None]] = None
    #: told, at the end of every backward, what the ranks agreed there (reduce.HEALTHY...)
    on_backward_end: Optional[Callable[[int], None]] = None
    #: every chunk is gathered in place (one rank, shards on the compute device): nothing
    #: evicts a chunk between a module's forward and its backward, so the per-module tensor
    #: hooks that fetch it again before its backward, and unpin it after, would only cost
    #: time; the outputs of one module a forward runs queue the end-of-backward callback
    lean: bool = False
    _end_hooked: bool = False  # lean: this forward's outputs already carry that hook
    #: chunks an optimizer step releases (set by ``ElixirOptimizer``: those it does not
    #: leave gathered); while any does, their next reads must go through the module hooks
    released_by_steps: frozenset[int] = frozenset()
    _unit_handles: list = field(default_factory=list)
    _units_on: bool = False
    #: slot index -> its post-accumulate-grad hook, for each trainable parameter that has one
    _grad_handles: dict = field(default_factory=dict)
    _grad_hooks_key: Optional[tuple] = None

    @property
    def resident(self) -> bool:
        """Every chunk stays gathered in place from one forward to the next: ``lean``, no
        optimizer step releases a chunk, no fault is injected. The module hooks would then
        only look up chunks that are there (tens of microseconds a module, which on a GPU is
        more than a small module's kernels), so they are not installed."""
        return self.lean and self.fault_check is None and not self.released_by_steps

    # ------------------------------------------------------------------ install / remove
    def install(self) -> None:
        self.lean = all(chunk.in_place for chunk in self.slot_chunk)
        self.handles.append(self.root.register_forward_pre_hook(self._root_pre_forward))
        self.handles.append(self.root.register_forward_hook(self._root_post_forward, always_call=True))
        manager = weakref.ref(self)  # the reader lives on the parameter: no strong cycle
        for slot, chunk in zip(self.slots, self.slot_chunk):
            attach_reader(slot.param, slot.name, slot.shape, _make_reader(manager, slot.name, chunk.index))
        self.sync_units()

    def sync_units(self) -> None:
        """Install the per-module hooks, or take them off, as ``resident`` now says (an
        optimizer, a fault injector may arrive after the first forward). So too the hooks
        of parameters whose ``.grad`` is their place in the gradient shard: resident, the
        reducer notes their gradients at the end of each backward (``collect_views``)."""
        self._sync_grad_hooks()
        if self._units_on == (not self.resident):
            return
        if self._units_on:
            for h in self._unit_handles:
                h.remove()
            self._unit_handles.clear()
        else:
            for module, cids in self.units.items():
                pre, post = self._make_pre_forward(cids)
                self._unit_handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                self._unit_handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
        self._units_on = not self._units_on

    def _sync_grad_hooks(self) -> None:
        collect = self.resident and bool(self.reducer.grad_views)
        key = (collect, len(self.reducer.grad_views))
        if key == self._grad_hooks_key:  # every root forward asks: answer at once
            return
        self._grad_hooks_key = key
        if collect != self.reducer.collecting:
            self.reducer.collect_views()  # what arrived under the old way is noted first
            self.reducer.start_collecting(collect)
        for slot, chunk in zip(self.slots, self.slot_chunk):
            want = not chunk.frozen and not (collect and slot.index in self.reducer.grad_views)
            handle = self._grad_handles.get(slot.index)
            if want and handle is None:
                self._grad_handles[slot.index] = slot.param.register_post_accumulate_grad_hook(
                    self._make_grad_hook(slot, chunk))
            elif not want and handle is not None:
                handle.remove()
                del self._grad_handles[slot.index]

    def _gather_released(self) -> None:
        """``resident``: gather every chunk a load or a recovery released. In place, at one
        rank, that moves nothing and is no collective: each parameter gets its view back."""
        released = [c.index for c in self.fetcher.chunks if c.state is not ChunkState.GATHERED]
        if released:
            self.fetcher.fetch(released)
            self.fetcher.unpin(released)

    def remove(self) -> None:
        self._grad_hooks_key = None
        for h in self.handles + self._unit_handles + list(self._grad_handles.values()):
            h.remove()
        self.handles.clear()
        self._unit_handles.clear()
        self._grad_handles.clear()
        self._units_on = False
        for slot in self.slots:
            detach_reader(slot.param)

    # ------------------------------------------------------------------ reads outside modules
    def read_released(self, name: str, cid: int) -> None:
        """A released parameter of chunk ``cid`` is being read outside its modules' hooks."""
        backward = in_backward()
        if not (self._forward_depth or backward or self._gathering_context):
            if not self.resident:
                raise released_read_error(name)
            # a submodule called on its own after a load: no unit hook gathered it, and at
            # one rank in place a gather is no collective, so any code may make it
            self._gather_released()
            return
        if backward:
            self._ensure_end_callback()
        self.fetcher.fetch([cid])
        self.hold([cid])

    def hold(self, cids: Sequence[int]) -> None:
        """Keep chunks already fetched (pinned) by the caller pinned until the backward that
        follows is over (``drop_holds``)."""
        self.holds.extend(cids)
        self.fetcher.held = self.holds

    def drop_holds(self) -> None:
        """Unpin every held chunk (end of backward, end of a no-grad forward, optimizer step)."""
        holds, self.holds = self.holds, []
        self.fetcher.held = self.holds
        self.fetcher.unpin(holds)

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not in_backward():
            if self._callback_queued:  # the last backward raised before it finished
                self._abandon_backward()
            self.sync_units()
            self.cache.begin_pass(record=torch.is_grad_enabled() and module.training)
            self._end_hooked = False
            if not self._units_on:
                self._gather_released()
        self._forward_depth += 1

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_depth -= 1
        if self._forward_depth or in_backward():
            return
        if not torch.is_grad_enabled():
            self.drop_holds()  # no graph saved a view of them: nothing to keep for
        elif not self._units_on:
            # Without module hooks, the model's outputs queue the end-of-backward callback,
            # from the outermost backward even when checkpointed layers run their own
            # (reentrant) backward inside it. Not a scalar: recovery differentiates the
            # user's loss by the model's loss (link_loss), which must not end a backward.
            outputs = [t for t in grad_tensors(output, []) if t.dim() > 0]
            on_output_grad(outputs, self._ensure_end_callback)

    def _make_pre_forward(self, cids: list[int]):
        stack: list[_Call] = []  # calls of this module still inside their forward

        def pre_forward(module: nn.Module, args: tuple, kwargs: dict):
            call = _Call(cids)
            stack.append(call)  # before fetching: post_forward runs (always_call) even if it fails
            self._forward_depth += 1
            self.fetcher.fetch(cids)
            call.fetched = True
            if self.fault_check is not None and torch.is_grad_enabled() and not in_backward():
                self.fault_check("forward")
            if torch.is_grad_enabled() and not self.lean:
                args, kwargs = alias_inputs((args, kwargs), lambda: self._post_backward(call))
            return args, kwargs

        def post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any):
            call = stack.pop()
            self._forward_depth -= 1
            if not call.fetched:  # the fetch failed and unpinned what it had pinned
                return output
            self.fetcher.unpin(call.cids)
            if not torch.is_grad_enabled():
                return output
            if not self.lean:
                on_output_grad(output, lambda: self._pre_backward(call))
            elif not self._end_hooked:
                # a module's output, not the model's: code that only differentiates the
                # user's loss by the model's loss (recovery's link_loss) does not reach it
                self._end_hooked = on_output_grad(output, self._ensure_end_callback) > 0
            return output

        return pre_forward, post_forward

    # ------------------------------------------------------------------ backward
    def watch(self, tensors: list[torch.Tensor]) -> int:
        """Make the gradient of ``tensors`` start the end-of-backward work, as the model's
        outputs do: for a forward whose loss does not pass through its outputs (the logits in
        pieces, runtime/logit_pieces.py). Returns how many tensors were hooked."""
        return on_output_grad(tensors, self._ensure_end_callback)

    def _ensure_end_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, call: _Call) -> None:
        self._ensure_end_callback()
        if call.pinned:
            return
        self.fetcher.fetch(call.cids)
        call.pinned = True
        self._open_calls.append(call)

    def _post_backward(self, call: _Call) -> None:
        if call.pinned and not call.done:
            call.done = True
            self.fetcher.unpin(call.cids)

    def _make_grad_hook(self, slot: Slot, chunk: Chunk):
        # The hook is stored on the parameter, and the garbage collector does not look
        # through a tensor's hooks: a strong reference back to this manager (which holds the
        # model, which holds the parameter) would keep the model alive for ever.
        manager = weakref.ref(self)
        index = slot.index

        def hook(param: torch.Tensor) -> None:
            live = manager()
            if live is not None:
                live._on_grad(index, param)

        return hook

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        self._ensure_end_callback()
        if self.fault_check is not None:
            self.fault_check("backward")
        grad = param.grad
        view = self.reducer.grad_views.get(index)
        if view is not None:  # autograd added it into the gradient shard
            self.reducer.grad_in_view(self.slots[index], grad, view)
            return
        param.grad = None
        if grad is not None:
            self.reducer.on_grad(self.slot_chunk[index], self.slots[index], grad)

    def _abandon_backward(self) -> None:
        """Forget a backward that raised: drop its pins and gradient buffers (no collectives,
        since other ranks may not have failed) so the next step starts clean."""
        self._callback_queued = False
        for call in self._open_calls:
            self._post_backward(call)
        self._open_calls.clear()
        self.drop_holds()
        self.reducer.abandon()

    def abandon_pass(self) -> None:
        """Forget a forward or backward that failed and was finished hollowly."""
        self._abandon_backward()

    def _end_backward(self) -> None:
        self._callback_queued = False
        self.reducer.collect_views()
        for call in self._open_calls:
            self._post_backward(call)
        self._open_calls.clear()
        self.drop_holds()
        self.reducer.end_backward()
        if self.on_backward_end is not None:
            self.on_backward_end(self.reducer.agreed)


def _make_reader(manager: "weakref.ReferenceType[HookManager]", name: str, cid: int):
    def read(param: torch.Tensor) -> None:
        live = manager()
        if live is None:
            raise ReleasedParameterError(
                f"hf_elixir: parameter {name!r} belongs to a runtime that no longer exists; its "
                "values are gone with it (save the model before dropping the ElixirModule)")
        live.read_released(name, cid)

    return read
