"""The planner times the model it plans (hf_elixir.measure.model_efficiency), issue 9.

- A shortened copy keeps the model's first blocks and their values: for every causal-LM
  architecture of the installed transformers where transformers itself can build the same
  model with one block, the one-block copy computes that model's loss exactly.
- For every architecture whose plain model trains, the measurement returns a figure (from
  shortened copies, or from the whole model where shortening breaks it) and leaves the
  model untouched.
- Extrapolating from one and two blocks prices the whole step exactly (pricing is additive).
- Ranks of a job time at once and plan with one figure; a one-process plan for two CPU
  ranks times in two processes; the figure reaches the candidates and the summary.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import asdict, replace

import pytest
import torch
from arch_configs import NotSmall, Skip, build_tiny, causal_lm_types, make_ids
from harness import process_pool, run_distributed
from tiny_models import make_model

import hf_elixir as hfe
from hf_elixir.measure import model_efficiency as me
from hf_elixir.hardware import HardwareProfile
from hf_elixir.planner import search
from hf_elixir.planner.record import PlanError
from hf_elixir.profile.memory import loss_of

CPU = torch.device("cpu")


def _figs():
    return HardwareProfile.preset("cpu").compute_figures(2)


def _local_hardware() -> HardwareProfile:
    """A CPU profile holding (preset-derived) figures, as a calibration of this machine would."""
    hw = HardwareProfile.preset("cpu")
    return replace(hw, compute={"shared": asdict(_figs()), "whole": asdict(_figs())}, device_memory=8 * 2**30)


def _one_block_reference(model, copy_1):
    """transformers' own model of this architecture with one block and the copy's weights,
    or None where its config cannot be told so (no ``num_hidden_layers``, other names).

    A model built with one block may also fold the depth into constants (MiniCPM3 scales each
    residual by ``1 / sqrt(num_hidden_layers)``); the copy keeps the deep model's, which is
    what it must time, so such numeric attributes are set to the copy's before comparing."""
    import transformers as tf

    cfg = copy.deepcopy(model.config)
    layers = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return None
    try:
        cfg.num_hidden_layers = 1
        for k, v in list(vars(cfg).items()):
            # per-layer lists; a pair of floats is a range (Mamba's time_step_limit), not two layers
            if isinstance(v, list) and len(v) == layers and layers > 1 and not all(type(x) is float for x in v):
                setattr(cfg, k, v[:1])
        ref = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().train()
        ref.load_state_dict(copy_1.state_dict(), strict=True)
    except Exception:
        return None
    ref.config.use_cache = False
    copied = dict(copy_1.named_modules())
    for name, module in ref.named_modules():
        twin = copied.get(name)
        for key, value in list(vars(module).items()):
            if type(value) in (int, float) and twin is not None and type(getattr(twin, key, None)) is type(value):
                setattr(module, key, getattr(twin, key))
    return ref


def _loss(model, ids) -> float:
    torch.manual_seed(0)
    return loss_of(model(input_ids=ids, labels=ids)).item()


def _check_architecture(arch: str) -> tuple[str, str | None]:
    """What measuring ``arch`` gives: ("skip" | "not_trainable" | "not_profiled" | "mixed" |
    "problem" | "whole" | "matched" | "timed", the problem or None)."""
    ids = make_ids(2, 8)
    model = build_tiny(arch)
    if isinstance(model, (Skip, NotSmall)):
        return "skip", None
    try:  # the reference: plain PyTorch trains it from input_ids (a model of its own: some
        # keep tensors of their last forward as attributes)
        plain = build_tiny(arch)
        loss_of(plain(input_ids=ids, labels=ids)).backward()
    except Exception:
        return "not_trainable", None
    try:  # and the planner prices it from its meta trace, which the measurement compares with
        hfe.profile_model(build_tiny(arch), (2, 8), dtype="fp32", attention_target="cpu", checkpointing=False)
    except Exception:
        return "not_profiled", None
    if me.block_list(model) is None:  # a hybrid whose layers are of several classes (olmo_hybrid):
        return "mixed", None          # measure() has no block to time and says so with None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = me.measure(model, (2, 8), _figs(), CPU, priced_whole=None)
    if got is None or not got.efficiency > 0:
        return "problem", f"not timed: {got}"
    after = model.state_dict()
    if set(after) != set(before) or any(not torch.equal(before[k], after[k]) for k in before):
        return "problem", "the measurement changed the model"
    if len(got.blocks_timed) == 1:
        return "whole", None
    one = me.reduced_copy(model, 1, CPU, torch.float32)
    ref = _one_block_reference(model, one)
    if ref is None:
        return "timed", None
    a, b = _loss(one, ids), _loss(ref, ids)
    if abs(a - b) > 1e-5 * max(1.0, abs(b)):
        return "problem", f"one-block copy's loss {a} != transformers' one-block model's {b}"
    return "matched", None


def test_every_architecture_is_timed_and_shortened_copies_match_transformers() -> None:
    # two processes, one architecture at a time each: the architectures are independent, and
    # the figures are only checked to exist
    archs = causal_lm_types()
    with process_pool(2) as pool:
        outcomes = dict(zip(archs, pool.map(_check_architecture, archs)))
    kinds: dict[str, list[str]] = {}
    for arch, (kind, _) in outcomes.items():
        kinds.setdefault(kind, []).append(arch)
    problems = {arch: problem for arch, (kind, problem) in outcomes.items() if kind == "problem"}
    timed = [a for a, (kind, _) in outcomes.items() if kind in ("whole", "matched", "timed")]
    matched, whole = kinds.get("matched", []), kinds.get("whole", [])
    print(f"\n{len(timed)} architectures timed ({len(whole)} whole: {whole}); {len(matched)} one-block copies "
          f"match transformers' own; plain model does not train: {kinds.get('not_trainable', [])}; no meta "
          f"profile: {kinds.get('not_profiled', [])}; blocks of several classes: {kinds.get('mixed', [])}")
    assert not problems, problems
    assert len(matched) >= 100  # most configs can be told their block count; the sweep found 137


def test_extrapolation_from_one_and_more_blocks_prices_the_whole_step() -> None:
    """A model too slow to time whole is timed with one block and with as many as a whole
    step's budget allows (two at least, fewer than all); either extrapolation prices the
    whole step exactly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=96, n_positions=64))
    longest = me.measure(model, (2, 16), _figs(), CPU, priced_whole=None)
    two = me.measure(model, (2, 16), _figs(), CPU, priced_whole=None, whole_step_seconds=0.0)
    whole = me.measure(model, (2, 16), _figs(), CPU, priced_whole=0.0)
    assert longest.blocks_timed == [1, 3] and two.blocks_timed == [1, 2]
    assert whole.blocks_timed == [longest.blocks] == [4]
    assert longest.priced_s == pytest.approx(whole.priced_s, rel=1e-9)
    assert two.priced_s == pytest.approx(whole.priced_s, rel=1e-9)
    assert longest.measured_s > 0 and whole.measured_s > 0 and longest.ranks == whole.ranks == 1
    assert me._longest([0.25, 0.375], 12, 1.0) == 7 and me._longest([0.9, 1.3], 12, 1.0) == 2


def test_a_config_is_timed_from_a_shortened_model() -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      vocab_size=256, max_position_embeddings=64)
    got = me.measure(cfg, (2, 16), _figs(), CPU, priced_whole=None)
    assert got.blocks == 6 and got.blocks_timed == [1, 5] and got.efficiency > 0
    shorter = me.measure(cfg, (2, 16), _figs(), CPU, priced_whole=None, whole_step_seconds=0.0)
    assert shorter.blocks_timed == [1, 2] and shorter.priced_s == pytest.approx(got.priced_s, rel=1e-9)
    assert cfg.num_hidden_layers == 6  # the caller's config is not changed


def _plan_in_job(rank: int, world: int) -> dict:
    model = make_model("llama")
    p = hfe.plan(model, (2, 16), hardware=_local_hardware(), world_size=world, dtype="fp32", efficiency="measure")
    plan = json.loads(p.to_json())
    for d in (plan["predictions"], plan["predictions"]["compute_efficiency"]):  # wall times differ
        for key in [k for k in d if k.endswith("seconds")]:
            del d[key]
    return {"plan": plan, "efficiency": p.predictions["compute_efficiency"]}


def test_ranks_of_a_job_time_together_and_plan_alike() -> None:
    a, b = run_distributed(_plan_in_job, 2)
    assert a["efficiency"]["source"] == "measured" and a["efficiency"]["ranks"] == 2
    assert a["efficiency"]["value"] == b["efficiency"]["value"] > 0
    assert a["plan"] == b["plan"]


def test_a_one_process_plan_for_two_cpu_ranks_times_in_two_processes() -> None:
    model = make_model("gpt2")
    hw = _local_hardware()
    p = hfe.plan(model, (2, 16), hardware=hw, world_size=2, dtype="fp32", efficiency="auto")
    eff = p.predictions["compute_efficiency"]
    assert eff["source"] == "measured" and eff["ranks"] == 2 and eff["used"] == eff["value"] > 0
    assert "measured on this machine" in p.summary()
    # the runners-up are re-priced at the same figure, so their predictions are the compared ones
    prof = hfe.profile_model(model, (2, 16), dtype="fp32", attention_target="cpu")
    alts = search.candidate_plans(p, prof, hw)
    assert alts and [a.predictions["step_time_s"] for a in alts] == pytest.approx(
        [a["step_time_s"] for a in p.alternatives], rel=1e-12)


def test_the_efficiency_argument() -> None:
    model = make_model("gpt2")
    prof = hfe.profile_model(model, (2, 16), dtype="fp32", attention_target="cpu")
    kw = dict(hardware="cpu", world_size=2, dtype="fp32", profile=prof)
    # a preset is not this machine: auto keeps the calibrated figure, measure says what to do
    auto = hfe.plan(model, (2, 16), **kw)
    assert auto.predictions["compute_efficiency"]["source"] == "calibrated"
    with pytest.raises(PlanError, match="hf-elixir calibrate"):
        hfe.plan(model, (2, 16), efficiency="measure", **kw)
    with pytest.raises(PlanError, match="efficiency must be"):
        hfe.plan(model, (2, 16), efficiency="fast", **kw)
    with pytest.raises(PlanError, match="positive"):
        hfe.plan(model, (2, 16), efficiency=0.0, **kw)
    # a given figure scales every priced operator
    one = search.enumerate_candidates(prof, HardwareProfile.preset("cpu"), 2, "float32", "adamw", 1.0)[0]
    two = search.enumerate_candidates(prof, HardwareProfile.preset("cpu"), 2, "float32", "adamw", 2.0)[0]
    for c1, c2 in zip(one, two):
        assert c2.time["compute"] > 1.9 * c1.time["compute"]
    given = hfe.plan(model, (2, 16), efficiency=1.5, **kw)
    assert given.predictions["compute_efficiency"] == {"value": 1.5, "source": "given", "used": 1.5}
