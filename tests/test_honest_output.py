"""What hf_elixir prints and plans is true: an offload fraction whole chunks cannot honour
warns, and a model whose own activation checkpointing is on is planned, priced and shown as
checkpointing (the runtime keeps the user's setting instead of replacing it)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_elixir.integrations.planning import make_plan
from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin
from hf_elixir.planner.record import ElixirPlan
from hf_elixir.planner.search import plan
from hf_elixir.profile.profiler import enable_checkpointing, model_checkpoints
from hf_elixir.runtime import ElixirModule, ElixirOptimizer


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def test_an_offload_fraction_whole_chunks_cannot_honour_warns() -> None:
    model = tiny_gpt2()
    n = sum(p.numel() for p in model.parameters())
    with pytest.warns(UserWarning, match=r"offload_fraction=0.5 cannot be honoured: .* 0 of the 1 chunk"):
        one_chunk = ElixirPlan.simple(model, world_size=1, chunk_size=n, offload_fraction=0.5)
    assert one_chunk.offload_fraction() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # many chunks: 0.5 lands near half, no warning
        many = ElixirPlan.simple(model, world_size=1, chunk_size=n // 16, offload_fraction=0.5)
    assert 0.3 < many.offload_fraction() < 0.7


def test_the_plan_follows_the_models_own_checkpointing() -> None:
    model = tiny_gpt2()
    plain = plan(model, (2, 16), hardware="cpu", world_size=2, efficiency="calibrated", memory_budget="64GiB")
    assert not plain.predictions["model_checkpointing"]
    assert "the model's own" not in plain.summary()
    enable_checkpointing(model)
    assert model_checkpoints(model)
    own = plan(model, (2, 16), hardware="cpu", world_size=2, efficiency="calibrated", memory_budget="64GiB")
    # a roomy budget: without the model's setting the search would not checkpoint
    assert not plain.activation_checkpointing and own.activation_checkpointing
    assert own.predictions["model_checkpointing"]
    assert all(a["activation_checkpointing"] for a in own.alternatives)
    assert "activation checkpointing: the model's own" in own.summary()
    assert own.predictions["activation_peak_bytes"]["checkpointed"] is not None


def test_pinned_plans_and_the_off_option_respect_the_models_checkpointing() -> None:
    model = tiny_gpt2()
    enable_checkpointing(model)
    pinned = make_plan(model, ElixirPlugin(rcache_blocks=4), world_size=1, dtype="fp32", optimizer="adamw",
                       batch_shape=(2, 16))
    assert pinned.activation_checkpointing and "checkpointing True" in pinned.summary()
    with pytest.raises(ElixirConfigError, match="turn one off"):
        make_plan(model, ElixirPlugin(activation_checkpointing="off"), world_size=1, dtype="fp32",
                  optimizer="adamw", batch_shape=(2, 16))


def test_the_runtime_keeps_the_users_checkpointing_setting() -> None:
    """The user checkpoints every second block; a plan that checkpoints must not re-enable it
    with its own arguments (every block), and the model still trains like plain PyTorch."""
    ref, model = tiny_gpt2(), tiny_gpt2()
    for m in (ref, model):
        enable_checkpointing(m, every_n_layers=2)
    assert [b.gradient_checkpointing for b in model.transformer.h] == [True, False]
    emodel = ElixirModule(model, ElixirPlan.simple(model, world_size=1, activation_checkpointing=True),
                          device="cpu")
    assert [b.gradient_checkpointing for b in model.transformer.h] == [True, False]
    # eps 1e-6 as in tests/equivalence.py: GPT-2's attention key bias has a zero true gradient,
    # and at eps 1e-8 Adam would turn its rounding noise into steps of the learning rate
    opt = ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    for step in range(2):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
        ref_loss = ref(input_ids=ids, labels=ids).loss
        loss = emodel(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, ref_loss)
        for o, lo in ((opt, loss), (ref_opt, ref_loss)):
            lo.backward()
            o.step()
            o.zero_grad()
    state, ref_state = emodel.state_dict(), ref.state_dict()
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
