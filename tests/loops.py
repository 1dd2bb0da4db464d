"""The two training loops the in-process tests run: plain PyTorch and hf_elixir.

A comparison between the two sides should compare the runtime and nothing else, so both
sides run one recipe, written once: per step, a backward over each micro-batch (its loss
divided by the number of micro-batches), optional clipping, the optimizer's step, the
scheduler's step, zero_grad. Tests differ only in the options they pass, and an option
changes no arithmetic it does not name: dividing by 1 and adding to 0 are exact, so a test
without accumulation gets the numbers the loop without those operations gave.

``batches`` is the stream of micro-batches (input ids, also the labels), ``accumulate`` of
them to a step; ``[ids] * steps`` trains ``steps`` steps on one batch. ``each_step(step)``
runs before each step (a model's control flow for that step, a counter to reset, the
learning rate the step uses). ``loss_fn(model, ids)`` is the loss of one micro-batch.
``after_backward(step)`` (plain side) runs once a step's micro-batches are all backward, before
clipping: gradients summed between ranks by hand, as data parallelism would.
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
EachStep = Callable[[int], object]


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own causal-LM loss on ``ids`` as labels; indexed by key, which a
    ModelOutput and the plain dicts of tests/quirk_models.py both accept."""
    return model(input_ids=ids, labels=ids)["loss"]


def _steps(batches: Iterable[torch.Tensor], accumulate: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """(step, its micro-batches); a stream that does not end on a whole step is a test bug."""
    stream = iter(batches)
    step = 0
    while micro := list(islice(stream, accumulate)):
        assert len(micro) == accumulate, f"{len(micro)} micro-batches left over, a step takes {accumulate}"
        yield step, micro
        step += 1


def plain_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[torch.Tensor], *,
                clip: Optional[float] = None, scheduler=None, accumulate: int = 1,
                loss_fn: Optional[LossFn] = None, each_step: Optional[EachStep] = None,
                after_backward: Optional[EachStep] = None) -> list[float]:
    """Plain PyTorch: the reference every comparison is against. ``model`` may be wrapped in
    DDP (or sharded by FSDP2): the loop is the same, and the loss is this rank's own.

    Returns each step's loss: the sum, in Python floats, of its micro-batches' divided losses.
    """
    loss_fn = loss_fn or lm_loss
    losses = []
    for step, micro in _steps(batches, accumulate):
        if each_step is not None:
            each_step(step)
        total = 0.0
        for ids in micro:
            loss = loss_fn(model, ids) / accumulate
            loss.backward()
            total += loss.item()
        if after_backward is not None:
            after_backward(step)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def elixir_steps(emodel: torch.nn.Module, eoptimizer, batches: Iterable[torch.Tensor], *,
                 clip: Optional[float] = None, scheduler=None, accumulate: int = 1,
                 loss_fn: Optional[LossFn] = None, each_step: Optional[EachStep] = None,
                 group: Optional[dist.ProcessGroup] = None, average: bool = True) -> list[float]:
    """The same recipe through an ElixirModule and its ElixirOptimizer (its backward, its
    clipping), each rank on its own micro-batches.

    Returns each step's loss: its micro-batches' divided losses summed in a float32 tensor
    on the host and, when distributed, averaged over the ranks of ``group`` (default: the
    default group) with an all_reduce after zero_grad. ``average=False`` keeps this rank's
    own loss and issues no collective: for a test that compares one rank's losses, or
    counts every collective a step issues.
    """
    loss_fn = loss_fn or lm_loss
    distributed = average and dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    losses = []
    for step, micro in _steps(batches, accumulate):
        if each_step is not None:
            each_step(step)
        total = torch.zeros(1)
        for ids in micro:
            loss = loss_fn(emodel, ids) / accumulate
            eoptimizer.backward(loss)
            total += loss.detach().cpu()
        if clip is not None:
            eoptimizer.clip_grad_norm_(clip)
        eoptimizer.step()
        if scheduler is not None:
            scheduler.step()
        eoptimizer.zero_grad()
        if world > 1:
            dist.all_reduce(total, group=group)
        losses.append(total.item() / world)
    return losses


def gathered_gradients(emodel, model: torch.nn.Module) -> dict:
    """After a backward: every parameter's averaged gradient, gathered whole from the chunks'
    gradient shards (collective), and the names of the modules whose inputs the hooks alias,
    for a test that compares them with plain PyTorch given the same identity views."""
    grads = {}
    for chunk in emodel.chunks:
        whole = torch.empty(chunk.size)
        dist.all_gather_into_tensor(whole, chunk.grad_shard)
        for slot in chunk.slots:
            grads[slot.name] = whole[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    hooked = {name for name, module in model.named_modules() if module in emodel.hooks.units}
    return {"grads": grads, "hooked": hooked}
