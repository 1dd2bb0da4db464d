"""One focused test per thing real models do that the runtime must survive (issue 8):
a module's output or input modified in place, a parent reading a child's weight, nesting
deeper than the rCache, a parameter larger than chunk_size. Each trains at world size 2
exactly like plain PyTorch; evaluation under no_grad matches too."""

from __future__ import annotations

import functools

import pytest
import torch

import hf_elixir as hfe
from equivalence import assert_matches
from harness import run_distributed
from loops import elixir_steps, gathered_gradients, plain_steps
from quirk_models import QUIRKS, make_quirk
from tiny_models import make_batch

STEPS, CHUNK = 3, 1024


def reference(name: str) -> dict:
    model = make_quirk(name)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    losses = plain_steps(model, opt, [make_batch(4, 12)] * STEPS, clip=1.0)
    with torch.no_grad():
        logits = model(input_ids=make_batch(2, 12, seed=5))["logits"]
    return {"losses": losses, "state": model.state_dict(), "eval_logits": logits}


def _elixir(rank: int, world_size: int, name: str, rcache_blocks: int | None) -> dict:
    model = make_quirk(name)
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=CHUNK, rcache_blocks=rcache_blocks,
                                 offload_fraction=0.5)
    em = hfe.ElixirModule(model, plan)
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6))
    losses = elixir_steps(em, eopt, [make_batch(4, 12)[rank * 2 : rank * 2 + 2]] * STEPS, clip=1.0)
    em.eval()
    with torch.no_grad():
        logits = em(input_ids=make_batch(2, 12, seed=5))["logits"]
    return {"losses": losses, "state": em.state_dict(), "eval_logits": logits, "plan": plan.to_json(),
            "summary": plan.summary(), "stats": em.memory_report()["cache_stats"]}


def _all(rank: int, world_size: int) -> dict:
    # every quirk at its traced rCache minimum (the fewest blocks, the most evictions)
    out = {}
    for name in QUIRKS:
        minimum = hfe.ElixirPlan.simple(make_quirk(name), world_size, chunk_size=CHUNK).min_rcache_blocks
        out[name] = _elixir(rank, world_size, name, minimum)
    return out


@functools.lru_cache(maxsize=None)
def results() -> dict:
    return run_distributed(_all, 2)[0]


def _check(name: str) -> dict:
    ref, got = reference(name), results()[name]
    assert_matches(ref, got, label=name)
    assert torch.allclose(got["eval_logits"], ref["eval_logits"], rtol=1e-4, atol=1e-5), name
    return got


def test_inplace_on_a_module_output() -> None:
    _check("inplace_output")


def test_inplace_on_a_module_input() -> None:
    _check("inplace_input")


def test_parent_reads_child_weights() -> None:
    got = _check("parent_reads_child")
    plan = hfe.ElixirPlan.from_json(got["plan"])
    assert sorted(plan.borrowed[""]) == ["router.classifier.weight", "router.conv1d.weight"]


def test_nesting_deeper_than_the_rcache_is_refused_with_the_minimum() -> None:
    model = make_quirk("deep_nesting")
    minimum = hfe.ElixirPlan.simple(model, 2, chunk_size=CHUNK).min_rcache_blocks
    assert minimum >= 3  # three nested modules, each with its own chunk
    with pytest.raises(hfe.PlanError, match=f"rcache_blocks >= {minimum}"):
        hfe.ElixirPlan.simple(model, 2, chunk_size=CHUNK, rcache_blocks=minimum - 1)
    got = _check("deep_nesting")  # and at exactly the minimum it trains
    assert got["stats"]["evictions"] > 0


def test_a_parameter_larger_than_chunk_size_gets_its_own_chunk() -> None:
    model = make_quirk("huge_embedding")
    plan = hfe.ElixirPlan.simple(model, 2, chunk_size=CHUNK)
    big = [c for c in plan.chunks if c.numel > CHUNK]
    assert [c.params for c in big] == [["embed.weight"], ["head.weight"]]
    assert "embed.weight alone: 3072 elements, more than chunk_size 1024" in plan.summary()
    _check("huge_embedding")


def test_a_residual_stream_into_a_norm_and_three_projections() -> None:
    _check("residual_into_norm")


# ---------------------------------------------------------------------- gradient grouping
def _first_gradients(rank: int, world_size: int) -> dict:
    """hf_elixir's averaged gradients after one backward (each rank on its half of the
    batch), gathered whole, and the modules whose inputs its hooks alias."""
    model = make_quirk("residual_into_norm")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=CHUNK))
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6))
    rows = make_batch(4, 12)[rank * 2 : rank * 2 + 2]
    eopt.backward(em(input_ids=rows, labels=rows)["loss"])
    return gathered_gradients(em, model)


def _plain_split_gradients(views: set[str]) -> dict:
    """Plain PyTorch's gradients for the same two halves, averaged, with identity views at
    the inputs of the ``views`` modules."""
    from arch_sweep import split_gradients, with_input_views

    model = with_input_views(make_quirk("residual_into_norm"), views)
    return split_gradients(model, make_batch(4, 12).chunk(2), lambda m, rows: m(input_ids=rows, labels=rows)["loss"])


def test_gradients_are_plain_pytorchs_with_the_hooks_identity_views() -> None:
    """Not one bit differs from plain PyTorch once plain PyTorch is given the identity views
    the hooks hand modules as inputs: what remains between hf_elixir and plain PyTorch is
    the grouping of sums those views cause, which the architecture sweep measures as a
    second sample of plain PyTorch's spread (arch_sweep.py). Without the views some bits
    differ, so the comparison is not blind."""
    got = run_distributed(_first_gradients, 2)[0]
    assert {"norm1", "norm2", "q", "k", "v"} <= got["hooked"]
    twin = _plain_split_gradients(got["hooked"])
    assert set(twin) == set(got["grads"])
    different = [name for name in twin if not torch.equal(twin[name], got["grads"][name])]
    assert not different, different
    plain = _plain_split_gradients(set())
    assert any(not torch.equal(plain[name], twin[name]) for name in twin)


# ---------------------------------------------------------------------- MoE auxiliary loss
def _moe_model():
    from tiny_models import make_model

    model = make_model("mixtral")
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.5
    return model


def _moe_plain(splits: int) -> dict:
    """Plain PyTorch; ``splits`` 2 is data parallelism by hand: each half's loss (with its
    own load-balancing statistic) averaged."""
    model = _moe_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    losses = plain_steps(model, opt, list(make_batch(4, 12).chunk(splits)) * STEPS, clip=1.0, accumulate=splits)
    return {"losses": losses, "state": model.state_dict()}


def _moe_elixir(rank: int, world_size: int) -> dict:
    model = _moe_model()
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=4096))
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6))
    losses = elixir_steps(em, eopt, [make_batch(4, 12)[rank * 2 : rank * 2 + 2]] * STEPS, clip=1.0)
    return {"losses": losses, "state": em.state_dict()}


def test_moe_aux_loss_is_per_rank_as_in_data_parallelism() -> None:
    """The load-balancing loss is a statistic of the batch it sees: each rank computes it on
    its own rows, as plain data parallelism does, not on the global batch."""
    got = run_distributed(_moe_elixir, 2)[0]
    assert_matches(_moe_plain(splits=2), got, label="moe aux, data parallel")
    whole = _moe_plain(splits=1)  # the whole batch's statistic trains the routers differently
    gates = [k for k in whole["state"] if "gate" in k and "experts" not in k]
    assert gates
    moved = max(((whole["state"][k] - got["state"][k]).norm() / whole["state"][k].norm()).item() for k in gates)
    assert moved > 1e-4, moved


# ---------------------------------------------------------------------- generate()
def _generate_borrowing_model(rank: int, world_size: int) -> dict:
    import copy

    from arch_configs import build_tiny, make_ids

    model = build_tiny("jetmoe")  # its attention reads experts.bias without calling experts
    model.eval()
    model.generation_config.pad_token_id = 0
    ref = copy.deepcopy(model)
    plan = hfe.ElixirPlan.simple(model, world_size)
    plan.rcache_blocks = plan.min_rcache_blocks
    em = hfe.ElixirModule(model, plan)
    em.eval()
    prompt = make_ids(2, 5, seed=3)
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True)
    return {"borrowed": plan.borrowed, "tokens": em.generate(prompt, **kw).tolist(),
            "ref_tokens": ref.generate(prompt, **kw).tolist()}


def test_generate_matches_for_a_model_that_reads_a_child_weight() -> None:
    for got in run_distributed(_generate_borrowing_model, 2):
        assert got["borrowed"], "the model must read a parameter it does not own"
        assert got["tokens"] == got["ref_tokens"]
