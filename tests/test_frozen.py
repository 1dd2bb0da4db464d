"""Frozen weights are sharded, never mixed with trainable ones, and train like plain PyTorch.

Each partly frozen case (tests/frozen_cases.py) trains at world size 2 over real gloo ranks
with an rCache at its minimum, so frozen chunks are released and gathered again in forward
and backward; the result must equal plain PyTorch's, frozen tensors must be bit-identical
to where they started, and each rank must hold only its shard of the frozen bytes.
"""

from __future__ import annotations

import pytest
import torch

from equivalence import assert_matches
from frozen_cases import CASES, elixir, frozen_state, reference
from harness import run_distributed

W = 2


@pytest.fixture(scope="module")
def runs() -> dict:
    out = {}
    for name in CASES:
        plan = dict(chunk_size=2048, rcache_blocks="min")
        out[name] = (reference(name), run_distributed(elixir, W, name, plan))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_partly_frozen_training_matches_plain_pytorch(runs, name) -> None:
    ref, ranks = runs[name]
    assert_matches(ref, ranks[0], label=name)


@pytest.mark.parametrize("name", list(CASES))
def test_frozen_weights_stay_bit_identical(runs, name) -> None:
    _, ranks = runs[name]
    start = frozen_state(name)
    assert start, f"{name} freezes nothing"
    for key, value in start.items():
        assert torch.equal(ranks[0]["state"][key], value), f"{name}: frozen {key} changed"


@pytest.mark.parametrize("name", list(CASES))
def test_frozen_chunks_hold_only_shards_and_no_training_state(runs, name) -> None:
    _, ranks = runs[name]
    for rank in ranks:
        plan = rank["plan"]
        frozen = [c["frozen"] for c in plan["chunks"]]
        assert any(frozen) and not all(frozen)
        # 1/W of the frozen bytes, plus the alignment padding of the frozen chunks
        peak = rank["memory"]["peak"]["frozen_shards"]
        assert peak <= rank["frozen_bytes"] / W + rank["frozen_padding"] / W
        assert peak >= rank["frozen_bytes"] / W
        for is_frozen, n_state, grad in zip(frozen, rank["optimizer_state_lengths"], rank["grad_shard_sizes"]):
            if is_frozen:
                assert n_state == 0 and grad == 0, "a frozen chunk carries optimizer state or gradients"
            else:
                assert n_state == 2 and grad > 0


def test_no_chunk_mixes_frozen_and_trainable_parameters() -> None:
    import hf_elixir as hfe
    from frozen_cases import build_case

    for name in CASES:
        model = build_case(name)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        plan = hfe.ElixirPlan.simple(model, W, chunk_size=1 << 20)
        for chunk in plan.chunks:
            kinds = {n in trainable for n in chunk.params}
            assert kinds == {not chunk.frozen}, f"{name}: chunk {chunk.params} mixes kinds"


def test_offloaded_frozen_chunks_train_identically() -> None:
    ref = reference("lora_llama")
    ranks = run_distributed(elixir, W, "lora_llama", dict(chunk_size=2048, offload_frozen=1.0))
    assert_matches(ref, ranks[0], label="frozen offloaded")
    for rank in ranks:
        assert all(c["param_placement"] == "cpu" for c in rank["plan"]["chunks"] if c["frozen"])
        # nothing frozen on the compute device: it is gathered from host memory
        assert rank["memory"]["peak"]["frozen_shards"] == 0


def test_a_plan_made_before_freezing_is_refused() -> None:
    import hf_elixir as hfe
    from hf_elixir.planner.record import PlanError
    from tiny_models import make_model

    model = make_model("gpt2")
    plan = hfe.ElixirPlan.simple(model, 1)
    model.transformer.wte.weight.requires_grad_(False)
    with pytest.raises(PlanError, match="frozen or unfrozen after planning"):
        plan.validate(model, world_size=1)


def _trainable_state(rank: int, world_size: int) -> tuple[list[str], dict, dict]:
    import hf_elixir as hfe
    from frozen_cases import build_case

    model = build_case("lora_gpt2")
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=2048))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return trainable, emodel.trainable_state_dict(), emodel.state_dict()


def test_the_trainable_state_dict_gathers_no_frozen_weight() -> None:
    for trainable, partial, full in run_distributed(_trainable_state, W):
        assert sorted(partial) == sorted(trainable)  # adapters only, no frozen base
        for key, value in partial.items():
            assert torch.equal(value, full[key])
