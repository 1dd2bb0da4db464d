"""The micro-batch lever: a batch the Trainer hands the model, run as several smaller ones.

A plan whose ``micro_batch_split`` is ``k`` (chosen by a recovery, or by the planner when
``auto_find_batch_size`` is on and the batch does not fit) has ``ElixirTrainer.training_step``
run each batch as ``k`` micro-batches, with the accumulation the loss is divided by ``k``
times larger. The optimizer steps, the LR schedule and the data order stay those of the run,
and the gradient is the one a run started with the smaller per-device batch (and ``k`` times
the accumulation) computes.

``TrainerSplitter`` gives the runtime the same split for the redo of a failed step
(``runtime/recovery.BatchSplitter``): each recorded forward's inputs cut along the batch, and
the weight each part's loss takes. The Trainer divides a per-micro-batch mean loss by the
accumulation (each part: ``1/k`` of the whole's factor); a loss the model already normalized
by the token count of the whole accumulation (``num_items_in_batch``) is summed as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Callable

import torch

from hf_elixir.runtime.recovery import MicroBatch


def batch_size_of(inputs: Any) -> int:
    """The batch dimension of a batch: the first dimension of its first tensor of rank >= 1."""
    values = inputs.values() if isinstance(inputs, Mapping) else inputs if isinstance(inputs, (tuple, list)) else [inputs]
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return v.shape[0]
    return 0


def split_inputs(inputs: Any, parts: int, size: int | None = None) -> list[Any]:
    """``inputs`` (a dict, tuple or list of tensors, or a tensor) cut into ``parts`` along the
    batch dimension; a value whose first dimension is not the batch's is passed to each part
    whole. Fewer parts come back when the batch has fewer rows."""
    size = batch_size_of(inputs) if size is None else size
    parts = max(1, min(parts, size))

    def cut(v: Any) -> list[Any]:
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == size:
            return list(torch.tensor_split(v, parts))
        return [v] * parts

    if isinstance(inputs, Mapping):
        pieces = {k: cut(v) for k, v in inputs.items()}
        out = [{k: pieces[k][i] for k in inputs} for i in range(parts)]
        if type(inputs) is not dict:  # a BatchEncoding stays one (its attribute access)
            try:
                out = [type(inputs)(o) for o in out]
            except TypeError:
                pass
        return out
    if isinstance(inputs, (tuple, list)):
        pieces = [cut(v) for v in inputs]
        return [type(inputs)(p[i] for p in pieces) for i in range(parts)]
    return cut(inputs)


class TrainerSplitter:
    """The runtime's view of the Trainer's micro-batch lever (see the module docstring)."""

    def __init__(self, batch_size: Callable[[], int]) -> None:
        self._batch_size = batch_size

    def can_split(self, split: int) -> bool:
        """Each batch as ``split`` micro-batches of equal size (so the gradient is that of a
        run with the smaller batch)."""
        b = self._batch_size()
        return split >= 1 and b >= split and b % split == 0

    def split(self, batch: MicroBatch, parts: int) -> list[tuple[MicroBatch, float]]:
        size = batch_size_of(batch.kwargs) or batch_size_of(batch.args)
        args = split_inputs(batch.args, parts, size) if batch.args else None
        kwargs = split_inputs(batch.kwargs, parts, size)
        n = len(kwargs)
        summed = batch.kwargs.get("num_items_in_batch") is not None
        weight = 1.0 if summed else 1.0 / n
        return [(replace(batch, args=tuple(args[i]) if args else (), kwargs=kwargs[i], split=batch.split * n),
                 weight) for i in range(n)]
