"""Folded profiles (``hf_elixir.profile.fold``): a deep model profiled from a few of its
layers must give exactly the profile of tracing every layer, or not be folded at all.

The reference is the profiler itself with ``fold=False``, which traces every layer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

from arch_configs import _tiny_on_meta, deep_tiny_config
from hf_elixir.profile import fold
from hf_elixir.profile.fold import LayerStack, same_profile
from hf_elixir.profile.profiler import profile_model

DEPTH = 9  # deeper than fold.MIN_LAYERS: folded by default


def _llama(layers: int = DEPTH) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def _differences(a, b) -> list[str]:
    return [f for f in fold.COMPARED if getattr(a, f) != getattr(b, f)]


def test_layer_stack_names() -> None:
    stack = LayerStack("model.layers")
    assert stack.index("model.layers.12.mlp.up_proj.weight") == 12
    assert stack.index("model.layers") is None and stack.index("model.norm.weight") is None
    assert stack.index("model.layers_extra.1.w") is None
    assert stack.shift("model.layers.3.self_attn.q_proj", 5) == "model.layers.8.self_attn.q_proj"
    assert stack.shift("lm_head.weight", 5) == "lm_head.weight"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_config_profile_folds_to_the_full_trace(dtype) -> None:
    folded = profile_model(_llama(), (2, 32), dtype=dtype)
    full = profile_model(_llama(), (2, 32), dtype=dtype, fold=False)
    assert folded.extra.get("traced_layers") == fold.TRACED  # it did fold
    assert "traced_layers" not in full.extra
    assert same_profile(folded, full), _differences(folded, full)
    assert len(folded.plain.trace.events) == len(full.plain.trace.events)
    assert folded.activation_peak(True) == full.activation_peak(True)


def test_qlora_builder_folds_to_the_full_trace() -> None:
    """The CLI's path for ``--load-in-4bit --lora-r``: the fine-tune is built from (shortened
    copies of) the config; folding must see packed weights, quantisation state and adapters
    exactly as a full trace does."""
    pytest.importorskip("bitsandbytes")
    from hf_elixir.profile.lora import meta_lora_model
    from hf_elixir.profile.quant import meta_4bit
    from hf_elixir.profile.trace import build_meta_model

    def build(config):
        return meta_lora_model(meta_4bit(build_meta_model(config, "bfloat16"), compute_dtype="bfloat16"), 8,
                               dtype="bfloat16")

    folded = profile_model(_llama(), (1, 32), dtype="bfloat16", build=build)
    full = profile_model(_llama(), (1, 32), dtype="bfloat16", build=build, fold=False)
    assert folded.extra.get("traced_layers") == fold.TRACED
    assert folded.n_packed_params > 0 and folded.n_params > 0
    assert same_profile(folded, full), _differences(folded, full)


def test_module_profile_folds_and_leaves_the_model_alone() -> None:
    """A real model (LoRA on it) is profiled from a meta copy of its first layers only."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_llama())
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    folded = profile_model(model, (2, 16), dtype="float32")
    full = profile_model(model, (2, 16), dtype="float32", fold=False)
    assert folded.extra.get("traced_layers") == fold.TRACED
    assert same_profile(folded, full), _differences(folded, full)
    assert model.config.num_hidden_layers == DEPTH and len(base.model.layers) == DEPTH
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_layers_of_two_kinds_are_traced_whole() -> None:
    """Gemma 2 alternates sliding-window and full attention: its config's per-layer list
    differs between layers, so nothing is folded, and the profile is the full trace's."""
    config = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, vocab_size=128, sliding_window=8)
    assert len(set(config.layer_types)) == 2
    folded = profile_model(config, (1, 32), dtype="float32")
    assert "traced_layers" not in folded.extra
    assert same_profile(folded, profile_model(config, (1, 32), dtype="float32", fold=False))


def test_a_layer_unlike_the_others_is_caught() -> None:
    """Layers whose config lists agree but whose modules do not (a wider MLP in the first
    layers only, a DeepSeek-style dense prefix) must fail the check against a deeper
    trace and be traced whole."""
    from transformers.models.llama import modeling_llama

    class Uneven(modeling_llama.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            wide = copy.deepcopy(config)
            wide.intermediate_size *= 2
            for layer in self.model.layers[:3]:  # the first three layers: twice as wide
                layer.mlp = modeling_llama.LlamaMLP(wide)

    def build(config):
        with torch.device("meta"):
            return Uneven(config)

    folded = profile_model(_llama(), (1, 16), dtype="float32", build=build)
    assert "traced_layers" not in folded.extra
    assert same_profile(folded, profile_model(_llama(), (1, 16), dtype="float32", build=build, fold=False))


def test_shallow_models_are_traced_whole() -> None:
    shallow = profile_model(_llama(fold.MIN_LAYERS - 1), (1, 16), dtype="float32")
    assert "traced_layers" not in shallow.extra


def test_fold_traces_a_few_layers_not_all() -> None:
    """A 64-layer model is profiled from traces of models a few layers deep (counted, not
    timed), and its profile has all 64 layers."""
    from hf_elixir.profile import profiler

    depths = []
    original = profiler.trace_step

    def counting(model, *args, **kwargs):
        depths.append(model.config.num_hidden_layers)
        return original(model, *args, **kwargs)

    profiler.trace_step = counting
    try:
        profile = profile_model(_llama(64), (1, 8), dtype="float32")
    finally:
        profiler.trace_step = original
    assert profile.extra.get("traced_layers") == fold.TRACED
    assert sorted(set(depths)) == [fold.TRACED, fold.TRACED + 1]
    assert len([p for p in profile.params if ".layers." in p.name]) == 64 * 9  # 9 weights a layer
    assert {e for _, e in profile.plain.trace.events if e.startswith("model.layers.63.")}


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "mamba"])
def test_meta_kernel_cache_changes_no_profile(model_type) -> None:
    """``profile.memory.META_KERNELS`` rebuilds what a meta kernel returned before: the
    profiles made with it equal those made running every kernel."""
    from hf_elixir.profile.memory import META_KERNELS

    config, _ = _tiny_on_meta(model_type)
    cached = [profile_model(config, (2, 16), dtype="float32") for _ in range(2)]  # the second: all hits
    META_KERNELS.enabled = False
    try:
        plain = profile_model(config, (2, 16), dtype="float32")
    finally:
        META_KERNELS.enabled = True
    for profile in cached:
        assert same_profile(profile, plain), _differences(profile, plain)


#: one of each kind: dense decoders, a mixture of experts that folds and ones that do not (a
#: dense prefix, per-layer kinds), state-space and hybrid stacks; benchmarks/sweep_fold.py
#: runs every architecture transformers ships
KINDS = ["gpt2", "bloom", "falcon", "mixtral", "qwen3_moe", "deepseek_v3", "gemma3_text", "mamba", "jamba"]


@pytest.mark.parametrize("model_type", KINDS)
def test_folded_profile_is_the_full_profile(model_type) -> None:
    config = deep_tiny_config(model_type, fold.MIN_LAYERS)
    folded = profile_model(config, (1, 16), dtype="float32")
    full = profile_model(config, (1, 16), dtype="float32", fold=False)
    assert same_profile(folded, full), _differences(folded, full)
    if model_type in ("gpt2", "bloom", "falcon", "mixtral", "mamba"):
        assert folded.extra.get("traced_layers") == fold.TRACED  # these do fold
