"""Module and parameter hooks: fetch before forward and backward, unpin after, hand off grads.

For a module that owns chunked parameters:
- pre-forward: fetch (gather and pin) its chunks; hand it aliases of its grad-requiring
  inputs whose gradient hook tells us when its backward is done;
- post-forward: unpin; hook its grad-requiring outputs so its chunks are fetched again
  before autograd runs its backward (see ``hf_elixir.grad_marks``: the model may modify
  both in place);
- each chunked parameter's post-accumulate-grad hook hands the gradient to the reducer.
At the end of every backward (an autograd engine callback) leftover pins are dropped and
the remaining chunks are reduce-scattered.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from hf_elixir.grad_marks import alias_inputs, on_output_grad
from hf_elixir.runtime.cache import RCache
from hf_elixir.runtime.chunk import Chunk, Slot
from hf_elixir.runtime.fetch import Fetcher
from hf_elixir.runtime.reduce import GradReducer


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

    # ------------------------------------------------------------------ install / remove
    def install(self) -> None:
        self.handles.append(self.root.register_forward_pre_hook(self._root_pre_forward))
        for module, cids in self.units.items():
            pre, post = self._make_pre_forward(cids)
            self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
        for slot, chunk in zip(self.slots, self.slot_chunk):
            self.handles.append(slot.param.register_post_accumulate_grad_hook(self._make_grad_hook(slot, chunk)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not in_backward():
            if self._callback_queued:  # the last backward raised before it finished
                self._abandon_backward()
            self.cache.begin_pass(record=torch.is_grad_enabled() and module.training)

    def _make_pre_forward(self, cids: list[int]):
        stack: list[_Call] = []  # calls of this module still inside their forward

        def pre_forward(module: nn.Module, args: tuple, kwargs: dict):
            call = _Call(cids)
            stack.append(call)  # before fetching: post_forward runs (always_call) even if it fails
            self.fetcher.fetch(cids)
            call.fetched = True
            if torch.is_grad_enabled():
                args, kwargs = alias_inputs((args, kwargs), lambda: self._post_backward(call))
            return args, kwargs

        def post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any):
            call = stack.pop()
            if not call.fetched:  # the fetch failed and unpinned what it had pinned
                return output
            self.fetcher.unpin(call.cids)
            if torch.is_grad_enabled():
                on_output_grad(output, lambda: self._pre_backward(call))
            return output

        return pre_forward, post_forward

    # ------------------------------------------------------------------ backward
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
        grad = param.grad
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
        self.reducer.abandon()

    def _end_backward(self) -> None:
        self._callback_queued = False
        for call in self._open_calls:
            self._post_backward(call)
        self._open_calls.clear()
        self.reducer.end_backward()
