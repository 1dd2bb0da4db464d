"""The re-planner of an out-of-memory recovery (planner/replan.py, planner/levers.py) and the
Trainer's micro-batch split (integrations/microbatch.py), in one process.

The recoveries themselves, between real processes, are tests/test_oom_recovery.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_elixir as hfe
from hf_elixir.integrations.microbatch import TrainerSplitter, split_inputs
from hf_elixir.integrations.planning import make_plan
from hf_elixir.integrations.plugin import ElixirPlugin
from hf_elixir.planner.record import PlanError
from hf_elixir.planner.replan import MARGIN_STEP, memory_target, tighten
from hf_elixir.runtime.recovery import MicroBatch


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


@pytest.fixture(scope="module")
def searched():
    return hfe.plan(_model(), (4, 16), world_size=2, dtype="float32", efficiency="calibrated")


def test_options_are_in_place_and_priced(searched) -> None:
    """Every option keeps the packing, needs less than the plan, and is faster than every
    option that needs less still (the only ones a memory target can choose)."""
    options = searched.predictions["recovery_options"]
    assert options
    peak = searched.predictions["peak_bytes"]
    assert all(o["peak_bytes"] < peak for o in options)
    unsplit = sorted((o for o in options if o["micro_batch_split"] == 1), key=lambda o: o["peak_bytes"])
    assert all(a["step_time_s"] > b["step_time_s"] for a, b in zip(unsplit, unsplit[1:]))
    assert any(o["micro_batch_split"] == 1 for o in options) and any(o["micro_batch_split"] > 1 for o in options)
    assert {o["micro_batch_split"] for o in options} <= {1, 2, 4}
    assert searched.predictions["smallest_peak_bytes_batch_1"] < searched.predictions["smallest_peak_bytes"] < peak


def test_tighten_takes_the_fastest_option_under_the_target(searched) -> None:
    options = searched.predictions["recovery_options"]
    target = memory_target(searched, 1)
    assert target == pytest.approx(searched.predictions["peak_bytes"] * (1 - MARGIN_STEP))
    new = tighten(searched, can_checkpoint=True, can_split=lambda k: True, target=target)
    under = [o for o in options if o["peak_bytes"] <= target]
    best = min(under, key=lambda o: o["step_time_s"])
    assert (new.activation_checkpointing, new.rcache_blocks, new.prefetch_depth, new.micro_batch_split) == (
        best["activation_checkpointing"], best["rcache_blocks"], best["prefetch_depth"], best["micro_batch_split"])
    assert new.predictions["peak_bytes"] == best["peak_bytes"] and new.predictions["recovery"] != "no change"
    assert new.digest() == searched.digest() or new.rcache_blocks != searched.rcache_blocks or \
        new.activation_checkpointing != searched.activation_checkpointing or new.prefetch_depth != searched.prefetch_depth
    # no splitting where the integration cannot split; nothing under a target below every option
    unsplit = tighten(searched, can_checkpoint=True, can_split=None, target=target)
    assert unsplit is None or unsplit.micro_batch_split == 1
    # a measured capacity below the prediction lowers the target
    lowest = min(o["peak_bytes"] for o in options)
    assert memory_target(searched, 1, available=lowest) == pytest.approx(lowest * (1 - MARGIN_STEP))
    # under a target no option meets, the least memory; below that, nothing is left
    least = tighten(searched, can_checkpoint=True, can_split=lambda k: True, target=lowest - 1)
    assert least.predictions["peak_bytes"] == lowest
    assert tighten(least, can_checkpoint=True, can_split=lambda k: True, target=lowest - 1) is None


def test_tighten_without_priced_options_follows_the_ladder() -> None:
    plan = hfe.ElixirPlan.simple(_model(), 2, chunk_size=8192, prefetch_depth=1)
    steps = []
    while plan is not None:
        plan = tighten(plan, can_checkpoint=True, can_split=lambda k: k <= 2)
        if plan is not None:
            steps.append(plan.predictions["recovery"])
    assert steps[0] == "activation checkpointing on"
    assert steps[1] == "micro-batch split 1 -> 2 (the same global batch)"
    assert steps[-1] == "prefetch depth 1 -> 0"


def test_auto_find_batch_size_plans_the_largest_micro_batch_that_fits() -> None:
    """On a budget where no plan for batch 4 fits, the split plan runs micro-batches of the
    largest size that fits and divides the batch; without ``split_batches``, the error."""
    model = _model()
    at = {b: hfe.plan(model, (b, 16), world_size=2, dtype="float32", efficiency="calibrated").predictions["smallest_peak_bytes"]
          for b in (4, 2)}
    plugin = ElixirPlugin(plan="auto", gpu_memory=f"{(at[4] + at[2]) // 2}B", efficiency="calibrated")
    with pytest.raises(PlanError, match="no plan fits"):
        make_plan(model, plugin, 2, "float32", "adamw", (4, 16))
    plan = make_plan(model, plugin, 2, "float32", "adamw", (4, 16), split_batches=True)
    assert plan.micro_batch_split == 2 and plan.predictions["batch_size"] == 2
    assert {o["micro_batch_split"] for o in plan.predictions["recovery_options"]} <= {2, 4}
    assert "runs as 2 micro-batches of 2" in plan.summary()
    assert hfe.ElixirPlan.from_json(plan.to_json()).micro_batch_split == 2


def test_split_inputs_cuts_along_the_batch() -> None:
    ids = torch.arange(12).reshape(4, 3)
    parts = split_inputs({"input_ids": ids, "labels": ids + 1, "num_items_in_batch": torch.tensor(9)}, 2)
    assert [p["input_ids"].tolist() for p in parts] == [ids[:2].tolist(), ids[2:].tolist()]
    assert all(p["num_items_in_batch"].item() == 9 for p in parts)
    assert [len(p[0]) for p in split_inputs((ids, ids), 4)] == [1, 1, 1, 1]
    assert len(split_inputs({"input_ids": ids[:1]}, 2)) == 1  # a batch of one stays whole


def test_trainer_splitter_weights_as_the_trainer_scales() -> None:
    """A mean loss is divided by the accumulation (each part 1/k of the whole's factor); a
    loss already normalized by the accumulation's token count is summed."""
    splitter = TrainerSplitter(lambda: 4)
    assert splitter.can_split(2) and splitter.can_split(4) and not splitter.can_split(3) and not splitter.can_split(8)
    ids = torch.arange(8).reshape(4, 2)
    mean = splitter.split(MicroBatch((), {"input_ids": ids, "labels": ids}, split=1), 2)
    assert [w for _, w in mean] == [0.5, 0.5] and [b.split for b, _ in mean] == [2, 2]
    summed = splitter.split(MicroBatch((), {"input_ids": ids, "labels": ids, "num_items_in_batch": 8}, split=2), 2)
    assert [w for _, w in summed] == [1.0, 1.0] and [b.split for b, _ in summed] == [4, 4]
    assert summed[1][0].kwargs["input_ids"].tolist() == ids[2:].tolist()
