"""The planner knows frozen weights (issue 25: point 2, acceptance 4 and 5).

The profile tells frozen parameters from trainable ones; the search packs them into chunks
of their own, prices those chunks as the runtime holds them (compute-dtype shards only,
gathered through the rCache, never reduced, no optimizer; still gathered after a step, they
are not gathered again) and offloads them to CPU memory when the budget asks for it. The
plans it makes for a PEFT LoRA model and for a model with frozen embeddings run in the
runtime at world size 2 (real gloo ranks), train like plain PyTorch, and the runtime's
ledger and byte counter read what the plan predicted. ``hf-elixir plan --lora-r`` plans a
LoRA fine-tune of a model one does not have, on hardware one does not have.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

import hf_elixir as hfe
from equivalence import assert_matches
from harness import run_distributed
from hf_elixir.hardware import HardwareProfile
from hf_elixir.planner import packing, search
from hf_elixir.planner.record import ElixirPlan, PlanError
from hf_elixir.profile.params import chunked_parameters
from hf_elixir.profile import profile_model
from loops import elixir_steps, plain_steps
from tiny_models import make_batch, make_model

W = 2
BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-2
PER_RANK = (BATCH // W, SEQ)


# ---------------------------------------------------------------------- models
def lora_gpt2() -> torch.nn.Module:
    """GPT-2 with LoRA r 4 on its attention projection: 1 K adapter weights over a frozen base."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = make_model("gpt2")
    # non-zero B, so the adapters change the output from the first step on
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                        init_lora_weights=False)
    return get_peft_model(model, config)


def frozen_embeddings() -> torch.nn.Module:
    """Llama with its input embedding frozen and its blocks and head trainable."""
    model = make_model("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


MODELS = {"lora_gpt2": lora_gpt2, "frozen_embeddings": frozen_embeddings}


def kinds(model: torch.nn.Module) -> dict[str, bool]:
    """name -> frozen?, for every chunked parameter."""
    return {n: not p.requires_grad for n, p in chunked_parameters(model)}


# ---------------------------------------------------------------------- profile and packing
def test_the_profile_separates_frozen_from_trainable_parameters() -> None:
    model = lora_gpt2()
    prof = profile_model(model, PER_RANK, dtype="bf16", attention_target="cpu")
    want = kinds(model)
    assert {p.name: p.frozen for p in prof.params} == want
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert prof.n_params == sum(p.numel() for p in trainable) == 2 * (4 * 32 + 96 * 4)
    assert prof.n_frozen_params == sum(p.numel() for p in frozen)
    assert prof.frozen_bytes == 2 * prof.n_frozen_params  # in the compute dtype, bf16
    # frozen weights are chunked like the rest, so they are no longer priced whole per rank
    assert prof.buffer_bytes == sum(b.numel() * b.element_size() for b in model.buffers())
    assert sorted(prof.param_order()) == sorted(want)
    # the width is the base's (32), not the adapters' rank (4), though adapters outnumber it
    assert prof.hidden_size == 32


def test_packing_never_mixes_frozen_and_trainable_parameters() -> None:
    for name, build in MODELS.items():
        model = build()
        want = kinds(model)
        prof = profile_model(model, PER_RANK, dtype="fp32", attention_target="cpu")
        _, packings = search.enumerate_candidates(prof, HardwareProfile.preset("cpu"), W, "float32", "adamw")
        sizes = {p.name: p.numel for p in prof.params}
        for S, chunks in packings.items():
            assert sorted(n for c in chunks for n in c) == sorted(want)
            for c in chunks:
                assert len({want[n] for n in c}) == 1, f"{name}: chunk {c} mixes frozen and trainable"
            # each kind packed greedily on its own, in first-use order: an adapter between two
            # base weights does not cut the base's chunk (nor the base the adapters' chunk)
            for frozen in (False, True):
                alone = packing.pack([n for n in prof.param_order() if want[n] == frozen], sizes, S)
                assert [c for c in chunks if want[c[0]] == frozen] == alone
        plan = hfe.plan(model, PER_RANK, hardware="cpu", world_size=W, dtype="fp32", profile=prof)
        plan.validate(model, world_size=W)  # every chunked parameter, kinds and signature match
        for c in plan.chunks:
            assert c.frozen == all(want[n] for n in c.params)


def test_pack_keeps_fetch_order_and_plain_packing_without_frozen_parameters() -> None:
    sizes = {"a": 4, "la": 1, "b": 4, "lb": 1, "c": 4}
    order = list(sizes)
    assert packing.pack(order, sizes, 8) == [["a", "la"], ["b", "lb"], ["c"]]
    # frozen base a, b, c with adapters la, lb: two kinds, each packed in order, listed by first use
    assert packing.pack(order, sizes, 8, frozen={"a", "b", "c"}) == [["a", "b"], ["la", "lb"], ["c"]]


# ---------------------------------------------------------------------- the cost of frozen chunks
def test_frozen_chunks_are_priced_without_training_state() -> None:
    """A frozen chunk costs its shard and its gathers, nothing else: the same model with the
    same packing predicts less memory, fewer bytes reduced and less optimizer time when its
    base is frozen, by exactly the training state of the base."""
    model = lora_gpt2()
    prof = profile_model(model, PER_RANK, dtype="bf16", attention_target="cuda")
    hw = HardwareProfile.preset("a100-80g")
    roomy = search.plan(model, PER_RANK, hardware=hw, world_size=W, dtype="bf16", profile=prof,
                        efficiency="calibrated")
    mem = roomy.predictions["memory"]
    sizes = {p.name: p.numel for p in prof.params}
    frozen_elems = sum(packing.layout_sizes([c.params for c in roomy.chunks if c.frozen], sizes, W, 2))
    train_elems = sum(packing.layout_sizes([c.params for c in roomy.chunks if not c.frozen], sizes, W, 2))
    assert mem["frozen_shards"] == frozen_elems // W * 2
    assert mem["parameters"] == train_elems // W * 2
    # master (4 B), AdamW state (8 B) and gradient shard (4 B) only for the trainable chunks
    assert mem["master_weights"] == train_elems // W * 4
    assert mem["optimizer_state"] == train_elems // W * 8
    assert roomy.predictions["frozen"]["bytes"] == prof.n_frozen_params * 2
    # a frozen chunk is never reduced: only trainable chunks' gradients go over the wire
    wire = roomy.predictions["comm_bytes_by_kind"]
    assert wire["reduce_scatter"] == train_elems * 2 * (W - 1) // W
    # with a block for every chunk, frozen chunks stay gathered from step to step: no gathers
    gathers = roomy.predictions["gathers_by_chunk"]
    assert roomy.rcache_blocks >= roomy.n_chunks
    assert [g for g, c in zip(gathers, roomy.chunks) if c.frozen] == [0] * len(roomy.frozen_chunks)
    assert all(g == 1 for g, c in zip(gathers, roomy.chunks) if not c.frozen)


def test_the_search_offloads_frozen_chunks_when_the_budget_needs_it() -> None:
    """Roomy: nothing offloaded. A budget below every plan that keeps the frozen shards on
    the device: frozen chunks go to CPU memory (uploads only, no downloads), before any
    trainable state does."""
    model = lora_gpt2()
    prof = profile_model(model, PER_RANK, dtype="bf16", attention_target="cuda")
    hw = HardwareProfile.preset("a100-80g")
    kw = dict(hardware=hw, world_size=W, dtype="bf16", profile=prof, efficiency="calibrated")
    roomy = search.plan(model, PER_RANK, **kw)
    assert all(c.param_placement == "device" and c.optim_placement == "device" for c in roomy.chunks)
    cands, _ = search.enumerate_candidates(prof, hw, W, "bfloat16", "adamw")
    kept = min(c.peak for c in cands if c.n_frozen_cpu == 0)
    assert min(c.peak for c in cands) < kept  # offloading frozen shards does save memory
    budget = int(kept) - 1
    tight = search.plan(model, PER_RANK, memory_budget=budget, **kw)
    tight.validate(model, world_size=W)
    assert tight.predictions["peak_bytes"] <= budget
    frozen_off = [c for c in tight.chunks if c.frozen and c.param_placement == "cpu"]
    assert frozen_off, "the budget needs frozen shards in CPU memory"
    if any(c.param_placement == "cpu" for c in tight.chunks if not c.frozen):
        assert len(frozen_off) == len(tight.frozen_chunks)  # frozen ones go first
    assert tight.predictions["memory"]["frozen_shards"] < roomy.predictions["memory"]["frozen_shards"]
    wire = tight.predictions["comm_bytes_by_kind"]
    assert wire["host_to_device"] > 0
    if not any(c.optim_placement == "cpu" for c in tight.chunks if not c.frozen):
        assert wire["device_to_host"] == 0  # read-only: uploaded, never written back
    # a sweep down from roomy: frozen offload only grows as the budget shrinks
    top = roomy.predictions["peak_bytes"]
    last = -1.0
    for f in (1.0, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1):
        try:
            p = search.plan(model, PER_RANK, memory_budget=int(budget + (top - budget) * f), **kw)
        except PlanError:
            break
        share = sum(c.param_placement == "cpu" for c in p.chunks if c.frozen) / len(p.frozen_chunks)
        assert share >= last
        last = share


def test_no_trainable_parameters_is_a_clear_error() -> None:
    model = make_model("gpt2")
    model.requires_grad_(False)
    with pytest.raises(PlanError, match="nothing to train"):
        hfe.plan(model, PER_RANK, hardware="cpu", world_size=W, dtype="fp32")


# ---------------------------------------------------------------------- in the runtime
def make_plans() -> dict[tuple[str, str], str]:
    """For each model: the roomy plan, and a plan for a budget that keeps only a few chunks
    gathered and puts frozen shards in CPU memory."""
    out = {}
    for name, build in MODELS.items():
        model = build()
        prof = profile_model(model, PER_RANK, dtype="fp32", attention_target="cpu")
        kw = dict(hardware="cpu", world_size=W, dtype="fp32", profile=prof, efficiency="calibrated")
        roomy = hfe.plan(model, PER_RANK, **kw)
        cands, _ = search.enumerate_candidates(prof, HardwareProfile.preset("cpu"), W, "float32", "adamw")
        tight = hfe.plan(model, PER_RANK, memory_budget=int(min(c.peak for c in cands if c.n_frozen_cpu == 0)) - 1,
                         **kw)
        out[(name, "roomy")], out[(name, "tight")] = roomy.to_json(), tight.to_json()
    return out


def _train(rank: int, world_size: int, name: str, plan_json: str) -> dict:
    """One rank: 1 + STEPS steps; the ledger, the byte counter over the last STEPS steps."""
    model = MODELS[name]()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=1e-6)
    em = hfe.ElixirModule(model, ElixirPlan.from_json(plan_json))
    eopt = hfe.ElixirOptimizer(em, opt)
    rows = make_batch(BATCH, SEQ)[rank * PER_RANK[0]: (rank + 1) * PER_RANK[0]]

    def count_from_step_1(step: int) -> None:
        if step == 1:
            em.comm_report(reset=True)

    losses = elixir_steps(em, eopt, [rows] * (1 + STEPS), clip=1.0, each_step=count_from_step_1)
    memory, comm = em.memory_report(), em.comm_report()
    state = em.state_dict()  # a collective: every rank gathers
    return {"losses": losses, "memory": memory, "comm": comm, "state": state if rank == 0 else None}


def _all(rank: int, world_size: int, plans: dict) -> dict:
    return {key: _train(rank, world_size, key[0], pj) for key, pj in plans.items()}


def reference(name: str) -> dict:
    model = MODELS[name]()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=1e-6)
    losses = plain_steps(model, opt, [make_batch(BATCH, SEQ)] * (1 + STEPS), clip=1.0)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@functools.lru_cache(maxsize=None)
def plans() -> dict:
    return make_plans()


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_distributed(_all, W, plans(), timeout=600)


@pytest.mark.parametrize("budget", ["roomy", "tight"])
@pytest.mark.parametrize("name", list(MODELS))
def test_searched_plans_run_and_the_runtime_reads_what_they_predict(name: str, budget: str) -> None:
    plan = ElixirPlan.from_json(plans()[(name, budget)])
    assert plan.frozen_chunks and len(plan.frozen_chunks) < plan.n_chunks
    pred = plan.predictions
    per_rank = results()
    assert_matches(reference(name), per_rank[0][(name, budget)], label=f"{name}/{budget}")
    for rank, by_plan in enumerate(per_rank):
        got = by_plan[(name, budget)]
        peak = got["memory"]["peak"]
        # the frozen shards the ledger holds are the ones predicted, byte for byte
        assert peak["frozen_shards"] == pred["memory"]["frozen_shards"], (rank, peak, pred["memory"])
        assert peak["param_shards"] == pred["memory"]["parameters"]
        assert got["memory"]["peak_total"] <= pred["ledger_peak_bytes"]
        # bytes on the wire per step as predicted: frozen chunks gathered (again only where the
        # rCache dropped them), never reduced
        per_step = {k: v * STEPS for k, v in pred["comm_bytes_by_kind"].items()}
        assert got["comm"]["bytes"] == per_step, (rank, got["comm"]["bytes"], per_step)
    if budget == "tight":
        assert any(c.param_placement == "cpu" for c in plan.chunks if c.frozen)
        assert pred["memory"]["frozen_shards"] < ElixirPlan.from_json(
            plans()[(name, "roomy")]).predictions["memory"]["frozen_shards"]
        assert plan.rcache_blocks < plan.n_chunks  # frozen chunks are gathered again each step
        assert sum(pred["gathers_by_chunk"][i] for i in plan.frozen_chunks) > 0


# ---------------------------------------------------------------------- the command line
def test_cli_plans_llama_2_13b_lora_on_two_24gib_gpus(tmp_path, capsys) -> None:
    """Acceptance 5: the 13B base (26 GB in bf16) does not fit one 24 GiB GPU whole; sharded
    over two, with LoRA r 16 on every projection, it does."""
    from hf_elixir.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", "meta-llama/Llama-2-13b-hf", "--hardware", "rtx4090", "--gpus", "2",
               "--gpu-memory", "24GiB", "--dtype", "bf16", "--lora-r", "16", "--efficiency", "calibrated",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    plan = ElixirPlan.from_json(out)
    pred = plan.predictions
    assert pred["peak_bytes"] <= 24 * 2**30 and plan.world_size == 2
    # adapters on all seven projections of 40 blocks: 40 * 16 * (4 * 2 * 5120 + 3 * (5120 + 13824))
    assert pred["n_params"] == 40 * 16 * (4 * 2 * 5120 + 3 * (5120 + 13824)) == 62_586_880
    assert 13.0e9 < pred["frozen"]["params"] < 13.1e9
    assert 26.0e9 < pred["frozen"]["bytes"] < 26.1e9  # the base, replicated, on every GPU
    on_gpu = pred["memory"]["frozen_shards"]
    assert on_gpu <= pred["frozen"]["bytes"] / 2 * 1.01  # at most its half per GPU
    assert all(len({c.frozen}) == 1 for c in plan.chunks) and plan.frozen_chunks
    # the table's figures are per GPU, and the summary says the replicated base would not fit
    assert "frozen/GPU" in text and "peak/GPU" in text and "memory per device (one GPU)" in text
    assert "frozen_shards" in text and "62.6M trainable + 13015.9M frozen" in text
    assert "would not have fitted on one GPU" in text and "26.0 GB" in text


def test_default_lora_targets_are_the_projections_of_the_decoder_blocks() -> None:
    """Found from the structure, not a table: GPT-2's are transposed Conv1D layers; the LM
    head and the embeddings are never among them."""
    from hf_elixir.profile.lora import default_lora_targets, meta_lora_model

    assert default_lora_targets(make_model("gpt2")) == ["c_attn", "c_proj", "c_fc"]
    assert default_lora_targets(make_model("opt")) == ["k_proj", "v_proj", "q_proj", "out_proj", "fc1", "fc2"]
    real = make_model("llama")
    lora = meta_lora_model(real, r=2)
    assert all(p.is_meta for p in lora.parameters()) and not any(p.is_meta for p in real.parameters())
    adapted = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert adapted and all(".lora_A." in n or ".lora_B." in n for n in adapted)
    assert len(adapted) == 2 * 7 * 2  # A and B, seven projections, two blocks


@pytest.fixture()
def tiny_config(tmp_path) -> str:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    path = tmp_path / "tiny-llama.json"
    path.write_text(cfg.to_json_string())
    return str(path)


def test_cli_lora_targets_default_to_every_projection_and_can_be_named(tiny_config, tmp_path, capsys) -> None:
    from hf_elixir.cli import main

    args = ["plan", tiny_config, "--hardware", "a100-40g", "--seq-len", "32", "--lora-r", "4",
            "--efficiency", "calibrated"]
    default, named = tmp_path / "default.json", tmp_path / "named.json"
    assert main([*args, "--json", str(default)]) == 0
    assert main([*args, "--lora-targets", "q_proj,v_proj", "--json", str(named)]) == 0
    capsys.readouterr()

    def adapted(path) -> set[str]:
        names = [n for c in ElixirPlan.from_json(path).chunks if not c.frozen for n in c.params]
        return {n.split(".lora_")[0].rsplit(".", 1)[1] for n in names}

    assert adapted(default) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert adapted(named) == {"q_proj", "v_proj"}
    # the LM head and the embeddings stay frozen (and are sharded like the rest of the base)
    frozen = {n for c in ElixirPlan.from_json(default).chunks if c.frozen for n in c.params}
    assert any(n.endswith("lm_head.weight") for n in frozen) and any("embed_tokens" in n for n in frozen)
    assert json.loads(default.read_text())["predictions"]["frozen"]["chunks"] >= 1


@pytest.mark.parametrize("extra,needle", [
    (["--lora-targets", "q_proj"], "--lora-targets needs --lora-r"),
    (["--lora-r", "4", "--lora-targets", "qq_proj"], "name no module"),
    (["--lora-r", "0"], "rank must be >= 1"),
])
def test_cli_lora_mistakes_get_a_clear_error(tiny_config, extra, needle, capsys) -> None:
    from hf_elixir.cli import main

    assert main(["plan", tiny_config, "--hardware", "a100-40g", "--seq-len", "32", *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err
