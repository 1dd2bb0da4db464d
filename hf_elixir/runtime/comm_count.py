"""Count the bytes any torch.distributed program moves, by the convention of plan/traffic.py.

``WireCounter`` is a ``TorchDispatchMode``: every c10d collective reaches the dispatcher as
an op (``c10d::allreduce_``, ``c10d::_allgather_base_``, ...; DTensor's functional
collectives as ``_c10d_functional::*``), whoever issues it: DDP's reducer, FSDP2's hooks,
DTensor's clipping, hf_elixir's runtime. Each is counted from its tensors' sizes and its
group's size, so every system is measured the same way (``benchmarks/bench_step.py``).

The runtime does not use this module (it keeps its own integer counter, which costs nothing);
tests use it to check that counter. Intercepting every op costs Python time per op, so a
benchmark times its steps without the mode and counts one extra step with it.

One path escapes a dispatch mode: a DTensor op (FSDP2's gradient-norm clipping) redistributes
inside DTensor's own dispatch, where modes are switched off, so its functional collectives
(``funcol.all_reduce``...) never reach the mode. While active, the counter therefore also
wraps those Python functions of ``torch.distributed._functional_collectives`` and counts
them there (and skips their ops in the mode, so nothing is counted twice).

A raw counter sees what was issued, not what it meant: hf_elixir's gloo gather is W
broadcasts of one shard (counted under ``broadcast`` here, under ``all_gather`` by the
runtime; the bytes are the same).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_elixir.planner.traffic import CommCounter

# op name -> (kind, the argument holding the buffer the convention measures: the gathered
# output of an all-gather, the full input of a reduce-scatter)
_C10D = {
    "broadcast_": ("broadcast", "tensors"),
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "allgather_": ("all_gather", "output_tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "broadcast_": "broadcast",
}
_IGNORED = {"barrier", "monitored_barrier_", "wait_tensor"}
# functional collectives (Python functions) -> kind, counted where DTensor calls them
_FUNCOL = {"all_reduce": "all_reduce", "all_gather_tensor": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter"}


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj)
    return 0


def _group(obj: Any):
    """The ProcessGroup behind a c10d op's argument (the dispatcher hands a ScriptObject)."""
    import torch.distributed as dist

    return obj if isinstance(obj, dist.ProcessGroup) else dist.ProcessGroup.unbox(obj)


def _bind(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


class WireCounter(TorchDispatchMode):
    """Counts, per kind, the bytes this rank receives in the collectives issued while it is
    active (``counter``: a CommCounter), and names any collective it cannot classify in
    ``unknown`` (so a new op shows up instead of silently counting zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = CommCounter()
        self.unknown: Counter[str] = Counter()
        self._in_funcol = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self):
        import torch.distributed._functional_collectives as funcol

        for name, kind in _FUNCOL.items():
            self._saved[name] = getattr(funcol, name)
            setattr(funcol, name, self._wrap(self._saved[name], kind))
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.distributed._functional_collectives as funcol

        try:
            return super().__exit__(*exc)
        finally:
            for name, fn in self._saved.items():
                setattr(funcol, name, fn)
            self._saved.clear()

    def _wrap(self, fn, kind: str):
        import inspect

        signature = inspect.signature(fn)

        def counted(tensor, *args, **kwargs):
            import torch.distributed._functional_collectives as funcol
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = signature.bind(tensor, *args, **kwargs).arguments["group"]
            size = _resolve_process_group(funcol._resolve_group_name(group)).size()
            nbytes = tensor.numel() * tensor.element_size() * (size if kind == "all_gather" else 1)
            self.counter.collective(kind, nbytes, size)
            self._in_funcol += 1
            try:
                return fn(tensor, *args, **kwargs)
            finally:
                self._in_funcol -= 1

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace == "c10d" or (namespace == "_c10d_functional" and not self._in_funcol):
            self._count(namespace, func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, namespace: str, func, args: tuple, kwargs: dict) -> None:
        name = func._schema.name.split("::", 1)[1]
        if name in _IGNORED:
            return
        bound = _bind(func, args, kwargs)
        if namespace == "c10d" and name in _C10D:
            kind, arg = _C10D[name]
            group = _group(bound["process_group"])
            size, rank = group.size(), group.rank()
            source = kind == "broadcast" and rank == bound["root_rank"]
            self.counter.collective(kind, _nbytes(bound[arg]), size, source=source)
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            from torch.distributed.distributed_c10d import _resolve_process_group

            kind = _FUNCTIONAL[name]
            group = _resolve_process_group(bound["group_name"])
            size, rank = group.size(), group.rank()
            data = bound.get("input", bound.get("inputs"))
            nbytes = _nbytes(data) * (size if kind == "all_gather" else 1)  # all-gather: the output
            source = kind == "broadcast" and rank == bound["src"]
            self.counter.collective(kind, nbytes, size, source=source)
        else:
            self.unknown[f"{namespace}::{name}"] += 1
