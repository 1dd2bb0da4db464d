"""Turn an ElixirPlugin and a model into an ElixirPlan, before anything is sharded.

Shared by the Accelerate and Trainer integrations: a plan comes from a JSON file, from the
user's pinned decisions (``ElixirPlan.simple``), or from the planner's search over the shape
of the first training batch. Everything here only reads the model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn

from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin
from hf_elixir.measure.disk import with_disk
from hf_elixir.planner.record import ElixirPlan, PlanError
from hf_elixir.planner.replan import with_split
from hf_elixir.profile.profiler import model_checkpoints
from hf_elixir.runtime.disk_tier import resolve_path
from hf_elixir.optimizers import DEFAULT as DEFAULT_OPTIMIZER, supported_message
from hf_elixir.runtime.update import algorithm_of
from hf_elixir.vocab import torch_dtype
from hf_elixir.planner.search import plan as search

# accelerate's mixed_precision names -> hf_elixir compute dtypes
MIXED_PRECISION_DTYPES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def optimizer_kind(optimizer: Optional[torch.optim.Optimizer]) -> str:
    """The planner's name of the update ``optimizer`` asks for (the runtime's
    ``algorithm_of``, so both read one optimizer the same way); the table's default when
    it is not known yet."""
    if optimizer is None:
        return DEFAULT_OPTIMIZER
    try:
        return algorithm_of(optimizer)
    except TypeError:
        raise ElixirConfigError(unsupported_optimizer_message(type(optimizer).__name__)) from None


def unsupported_optimizer_message(name: str) -> str:
    return supported_message(name)


def compute_dtype(mixed_precision: str) -> str:
    try:
        return MIXED_PRECISION_DTYPES[str(mixed_precision)]
    except KeyError:
        raise ElixirConfigError(
            f"hf_elixir runs in fp32, bf16 or fp16; mixed_precision={mixed_precision!r} is not supported"
        ) from None


def machines_from_env(world_size: int) -> int:
    """How many machines this run spans: ``WORLD_SIZE`` ranks over ``LOCAL_WORLD_SIZE`` per
    machine, as torchrun (under ``accelerate launch`` and ``hf-elixir launch``) sets them.
    One machine when they are not set or do not divide (a hand-made process group)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", world_size))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        return 1
    if world != world_size or local < 1 or world % local:
        return 1
    return world // local


def make_plan(
    model: nn.Module,
    plugin: ElixirPlugin,
    world_size: int,
    dtype: str,
    optimizer: str,
    batch_shape: Optional[tuple[int, int]],
    machines: int = 1,
    split_batches: bool = False,
) -> ElixirPlan:
    """``plan_for``'s plan, with the user's ``logit_piece_tokens`` over the plan's (a
    copy: a searched plan is shared with the search's memo)."""
    plan = plan_for(model, plugin, world_size, dtype, optimizer, batch_shape, machines, split_batches)
    if plugin.logit_piece_tokens is not None and plugin.logit_piece_tokens != plan.logit_piece_tokens:
        plan = dataclasses.replace(plan, logit_piece_tokens=plugin.logit_piece_tokens)
    return plan


def plan_for(
    model: nn.Module,
    plugin: ElixirPlugin,
    world_size: int,
    dtype: str,
    optimizer: str,
    batch_shape: Optional[tuple[int, int]],
    machines: int = 1,
    split_batches: bool = False,
) -> ElixirPlan:
    """The plan to run ``model`` with, checked against the model and the world size.

    ``machines``: how many machines the ranks span (``machines_from_env``); a searched plan
    prices the link between them. ``split_batches`` (the Trainer's ``auto_find_batch_size``):
    when no plan fits the batch, plan the largest micro-batch that fits instead (``plan_split``).

    Raises ElixirConfigError (or PlanError) saying what to change; the model is untouched.
    """
    if plugin.activation_checkpointing == "off" and model_checkpoints(model):
        raise ElixirConfigError(
            "the elixir option activation_checkpointing is off, but the model's own activation "
            "checkpointing is on (gradient_checkpointing_enable(), or the Trainer's "
            "--gradient_checkpointing), and the model checkpoints whatever the plan says; turn one off"
        )
    if plugin.plan != "auto":
        try:
            plan = ElixirPlan.from_json(plugin.plan)
        except (OSError, ValueError) as e:
            raise ElixirConfigError(f"cannot read the plan {plugin.plan}: {e}") from None
        try:
            plan.validate(model, world_size=world_size)
        except PlanError as e:
            raise PlanError(
                f"the plan {plugin.plan} does not fit this run: {e}. Make a new one with "
                "`hf-elixir plan MODEL --gpus N --json plan.json`, or set plan: auto"
            ) from None
        return plan
    if plugin.pinned:
        itemsize = torch.empty((), dtype=torch_dtype(dtype)).element_size()
        chunk = None if plugin.chunk_size_mb is None else max(1, int(plugin.chunk_size_mb * 2**20 / itemsize))
        plan = ElixirPlan.simple(
            model,
            world_size=world_size,
            chunk_size=chunk,
            rcache_blocks=plugin.rcache_blocks,
            offload_fraction=plugin.offload_fraction(),
            compute_dtype=dtype,
            # the model's own checkpointing, when the user turned it on, runs whatever we pin
            activation_checkpointing=plugin.activation_checkpointing == "on" or model_checkpoints(model),
        )
        plan.validate(model, world_size=world_size)
        return plan
    if batch_shape is None:
        raise ElixirConfigError(
            "hf_elixir's planner needs the (batch size, sequence length) of a training batch and "
            "was given none; set the batch_size and seq_len elixir options, or pin the plan "
            "(chunk_size_mb, rcache_blocks, offload) or give a plan file"
        )


    # with a disk tier named (nvme_path, ELIXIR_NVME_PATH) the search may use it, priced at
    # that disk's measured bandwidth (cached per machine and path) and sized to its free space
    nvme = resolve_path(plugin.nvme_path)
    hardware = with_disk(plugin.hardware, nvme) if nvme is not None else plugin.hardware

    def searched(shape: tuple[int, int]) -> ElixirPlan:
        return search(model, shape, hardware=hardware, world_size=world_size, dtype=dtype,
                      optimizer=optimizer, memory_budget=plugin.gpu_memory, efficiency=plugin.efficiency,
                      nodes=machines, nvme=nvme is not None)

    try:
        return searched(batch_shape)
    except PlanError as error:
        if not split_batches:
            raise
        return plan_split(searched, batch_shape, error)


def plan_split(searched: Callable[[tuple[int, int]], ElixirPlan], batch_shape: tuple[int, int],
               error: PlanError) -> ElixirPlan:
    """``auto_find_batch_size`` the hf_elixir way: the batch of ``batch_shape`` does not fit
    (``error``), so plan the largest micro-batch that divides it and fits, and run each batch
    as that many micro-batches (``ElixirPlan.micro_batch_split``). The global batch, the
    optimizer steps and the LR schedule stay the script's. Raises ``error`` when even one
    sequence per micro-batch does not fit."""
    batch, seq = batch_shape
    for split in range(2, batch + 1):  # the largest micro-batch first (the error's largest-batch
        if batch % split:              # figure is an estimate, so each is planned)
            continue
        try:
            plan = searched((batch // split, seq))
        except PlanError:
            continue
        return with_split(plan, split)
    raise error


def batch_shape_from_loader(loader) -> Optional[tuple[int, int]]:
    """(per-device batch size, sequence length) of a DataLoader's first batch, or None when
    it cannot be told without drawing from the loader (an iterable dataset, a batch sampler
    of varying sizes, a batch with no 2-D token tensor).

    The batch is collated from the first dataset items, not drawn from the loader, so the
    sampler's random state (and so the data order of the run) is untouched. None is not an
    error: the model is then planned on its first forward, from the real inputs.
    """
    dataset = getattr(loader, "dataset", None)
    batch_size = getattr(loader, "batch_size", None)
    if batch_size is None and getattr(loader, "batch_sampler", None) is not None:
        batch_size = getattr(loader.batch_sampler, "batch_size", None)
    if dataset is None or not batch_size or not hasattr(dataset, "__getitem__"):
        return None
    try:
        n = min(int(batch_size), len(dataset))
        items = [dataset[i] for i in range(n)]
        batch = loader.collate_fn(items) if loader.collate_fn is not None else items
    except Exception:  # an iterable or unusual dataset: plan on the first forward instead
        return None
    ids = token_tensor(batch)
    if ids is None:
        return None
    return int(batch_size), int(ids.shape[1])


def token_tensor(batch: Any) -> Optional[torch.Tensor]:
    """The 2-D integer (batch, sequence) tensor of a collated batch, whatever its structure:
    the batch itself (``DataLoader(tensor)``), the first such tensor of a tuple or list
    (``TensorDataset``, ``(x, y)``), or of a mapping (``input_ids`` first, then any key:
    ``BatchEncoding``, custom dicts). None when there is none."""
    if _is_tokens(batch):
        return batch
    if isinstance(batch, Mapping):
        values = ([batch["input_ids"]] if "input_ids" in batch else []) + list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return None
    return next((v for v in values if _is_tokens(v)), None)


def _is_tokens(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() == 2 and not value.is_floating_point() and not value.is_complex()


def batch_shape_from_inputs(args: tuple, kwargs: dict) -> Optional[tuple[int, int]]:
    """(batch size, sequence length) of one forward call's inputs: ``input_ids``, else
    ``inputs_embeds`` (batch, sequence, hidden), else the first 2-D integer tensor among the
    arguments. None when the call has none of them."""
    ids = kwargs.get("input_ids")
    if _is_tokens(ids):
        return int(ids.shape[0]), int(ids.shape[1])
    embeds = kwargs.get("inputs_embeds")
    if torch.is_tensor(embeds) and embeds.dim() == 3:
        return int(embeds.shape[0]), int(embeds.shape[1])
    found = token_tensor(list(args) + list(kwargs.values()))
    return None if found is None else (int(found.shape[0]), int(found.shape[1]))
