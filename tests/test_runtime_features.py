"""Acceptance 3-7 of the runtime: tied weights, precision, generate, memory, bad input."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_elixir as hfe
from equivalence import assert_state_close, reference_run
from harness import run_distributed
from loops import elixir_steps, plain_steps
from tiny_models import make_batch, make_model


# ---------------------------------------------------------------------- 3. tied weights
def _tied(rank: int, world_size: int) -> dict:
    model = make_model("gpt2")
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=4096, rcache_blocks=3)
    em = hfe.ElixirModule(model, plan)
    wte, head = model.transformer.wte.weight, model.lm_head.weight
    grads = []
    real_on_grad = em.reducer.on_grad

    def count(chunk, slot, grad):
        grads.append(slot.name)
        real_on_grad(chunk, slot, grad)

    em.reducer.on_grad = count
    ids = make_batch(4, 16)
    em(input_ids=ids, labels=ids).loss.backward()
    return {
        "same_object": wte is head,
        "names": [n for n, _ in em.named_parameters()],
        "plan_names": plan.param_names(),
        "grads": grads,
    }


def test_tied_weights_are_one_parameter_with_one_gradient() -> None:
    got = run_distributed(_tied, 2)[0]
    assert got["same_object"]
    assert got["plan_names"].count("transformer.wte.weight") == 1
    assert "lm_head.weight" not in got["plan_names"]
    assert got["grads"].count("transformer.wte.weight") == 1
    assert len(got["grads"]) == len(got["plan_names"])  # one gradient per parameter
    # and GPT-2 (tied) trains like the reference: tests/test_equivalence.py::gpt2


# ---------------------------------------------------------------------- 4. precision
def _bf16_vs_fp32(rank: int, world_size: int) -> list[float]:
    from equivalence import elixir_run

    return elixir_run(rank, world_size, "llama", dict(chunk_size=4096, compute_dtype="bf16"), steps=20)["losses"]


def test_bf16_follows_fp32_reference_within_2_percent() -> None:
    bf16 = run_distributed(_bf16_vs_fp32, 2)[0]
    fp32 = reference_run("llama", steps=20)["losses"]
    assert fp32[-1] < fp32[0] * 0.9, "the recipe must actually train"
    for step, (a, b) in enumerate(zip(fp32, bf16)):
        assert abs(a - b) <= 0.02 * a, f"step {step}: bf16 loss {b} vs fp32 {a}"


def _fp16_inf(rank: int, world_size: int) -> dict:
    model = make_model("llama")
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=4096, compute_dtype="fp16")
    em = hfe.ElixirModule(model, plan)
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = make_batch(4, 16)[rank * 2 : rank * 2 + 2]
    log = []
    for step in range(3):
        handle = None
        if step == 1 and rank == 1:  # only one rank sees the overflow
            handle = model.model.layers[0].mlp.up_proj.weight.register_hook(lambda g: g * float("inf"))
        before = em.state_dict()
        scale = eopt.scaler.scale
        eopt.backward(em(input_ids=ids, labels=ids).loss)
        eopt.step()
        eopt.zero_grad()
        after = em.state_dict()
        if handle:
            handle.remove()
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        log.append({"scale_before": scale, "scale_after": eopt.scaler.scale, "changed": changed})
    return {"log": log, "skipped": getattr(eopt, "skipped_steps", 0)}


def test_fp16_overflow_skips_the_step_on_every_rank() -> None:
    results = run_distributed(_fp16_inf, 2)
    for rank, got in enumerate(results):
        log = got["log"]
        assert log[0]["changed"] and log[2]["changed"], f"rank {rank}: clean steps must update"
        assert not log[1]["changed"], f"rank {rank}: the overflow step changed weights"
        assert log[1]["scale_after"] == log[1]["scale_before"] / 2
        assert got["skipped"] == 1


# ---------------------------------------------------------------------- 5. generate and eval
def _generate(rank: int, world_size: int) -> dict:
    out = {}
    for arch in ("gpt2", "llama"):
        model = make_model(arch)
        model.generation_config.pad_token_id = 0
        ref = copy.deepcopy(model).eval()
        em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=4096, rcache_blocks=2))
        em.eval()
        prompt = make_batch(2, 5, seed=7)
        kw = dict(max_new_tokens=8, do_sample=False, use_cache=True)
        with torch.no_grad():
            logits = em(input_ids=prompt).logits
            ref_logits = ref(input_ids=prompt).logits
        out[arch] = {
            "tokens": em.generate(prompt, **kw).tolist(),
            "ref_tokens": ref.generate(prompt, **kw).tolist(),
            "logits_err": (logits - ref_logits).abs().max().item(),
        }
    return out


def test_greedy_generate_and_eval_match_the_unwrapped_model() -> None:
    for rank_out in run_distributed(_generate, 2):
        for arch, got in rank_out.items():
            assert got["tokens"] == got["ref_tokens"], arch
            assert got["logits_err"] < 1e-5, arch


# ---------------------------------------------------------------------- 6. memory accounting
def _memory(rank: int, world_size: int) -> dict:
    from hf_elixir.runtime.chunk import Chunk

    from tiny_models import UniformLM

    out = {}
    for name, kw in {"rcache2": dict(rcache_blocks=2), "off0": dict(), "off50": dict(offload_fraction=0.5)}.items():
        torch.manual_seed(0)
        model = UniformLM()  # four equal chunks, so "half the chunks" is half the state
        plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=3072, **kw)
        em = hfe.ElixirModule(model, plan)
        eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-3))
        # independent of the ledger: bytes of gathered storage actually allocated
        peak = [0]
        real_start = Chunk.start_gather

        def watch(self, async_op, _real=real_start):
            _real(self, async_op)
            held = sum(c.full.untyped_storage().nbytes() for c in em.chunks)
            peak[0] = max(peak[0], held)

        Chunk.start_gather = watch
        try:
            elixir_steps(em, eopt, [make_batch(4, 16)[rank * 2 : rank * 2 + 2]] * 2)
        finally:
            Chunk.start_gather = real_start
        out[name] = {"report": em.memory_report(), "storage_peak": peak[0], "n_chunks": plan.n_chunks}
    return out


def test_memory_accounting_is_exact() -> None:
    got = run_distributed(_memory, 2)[0]
    r2 = got["rcache2"]
    block = r2["report"]["rcache_block_bytes"]
    assert r2["n_chunks"] > 2 and r2["report"]["cache_stats"]["evictions"] > 0
    assert r2["storage_peak"] <= 2 * block
    assert r2["report"]["peak"]["rcache"] <= 2 * block
    assert r2["report"]["peak"]["rcache"] == r2["storage_peak"]
    assert got["off0"]["n_chunks"] == 4
    full = got["off0"]["report"]["current"]["optimizer_state"]
    half = got["off50"]["report"]["current"]["optimizer_state"]
    assert full > 0 and half * 2 == full
    assert got["off50"]["report"]["current"]["grad_shards"] * 2 == got["off0"]["report"]["current"]["grad_shards"]


# ---------------------------------------------------------------------- schedulers, state dicts
def test_lr_schedulers_drive_the_elixir_optimizer() -> None:
    from transformers import get_linear_schedule_with_warmup

    model = make_model("llama")
    ref = copy.deepcopy(model)
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096))
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)  # eps: see equivalence.py
    sched = get_linear_schedule_with_warmup(eopt, num_warmup_steps=2, num_training_steps=6)
    rsched = get_linear_schedule_with_warmup(ropt, num_warmup_steps=2, num_training_steps=6)
    ids = make_batch(4, 16)
    got: list[float] = []  # the lr of each step
    elixir_steps(em, eopt, [ids] * 4, scheduler=sched, each_step=lambda _: got.append(eopt.param_groups[0]["lr"]))
    want: list[float] = []
    plain_steps(ref, ropt, [ids] * 4, scheduler=rsched, each_step=lambda _: want.append(ropt.param_groups[0]["lr"]))
    # the lr after each step: the next step's, and after the last step the optimizer's
    assert got[1:] + [eopt.param_groups[0]["lr"]] == want[1:] + [ropt.param_groups[0]["lr"]]
    assert_state_close(ref.state_dict(), em.state_dict(), label="scheduled")


def _optimizer_state(rank: int, world_size: int) -> dict:
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=4096, offload_fraction=0.5))
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = make_batch(4, 16)[rank * 2 : rank * 2 + 2]

    def train(steps):  # each rank's own losses
        return elixir_steps(em, eopt, [ids] * steps, average=False)

    train(2)
    model_state, opt_state = em.state_dict(), eopt.state_dict()
    continued = train(2)
    em.load_state_dict(model_state)
    eopt.load_state_dict(opt_state)
    resumed = train(2)
    return {"continued": continued, "resumed": resumed, "opt_state": opt_state if rank == 0 else None}


def test_optimizer_state_dict_round_trips_and_matches_torch_format() -> None:
    got = run_distributed(_optimizer_state, 2)[0]
    assert got["continued"] == got["resumed"]
    # same layout as torch.optim.AdamW's own state_dict for the unsharded model
    model = make_model("llama")
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = make_batch(4, 16)
    model(input_ids=ids, labels=ids).loss.backward()
    torch_opt.step()
    want = torch_opt.state_dict()
    have = got["opt_state"]
    assert set(have["state"]) == set(want["state"])
    for idx, entry in want["state"].items():
        assert set(have["state"][idx]) == set(entry)
        assert have["state"][idx]["exp_avg"].shape == entry["exp_avg"].shape
        assert float(have["state"][idx]["step"]) == 2.0
    assert [g["params"] for g in have["param_groups"]] == [g["params"] for g in want["param_groups"]]


# ---------------------------------------------------------------------- 7. bad input
def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_untouched(model, snap) -> None:
    now = model.state_dict()
    assert all(torch.equal(now[k], snap[k]) for k in snap)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not getattr(model, "_hf_elixir_wrapped", False)


def _add_missing(plan) -> None:
    plan.chunks[0].params.append("model.layers.9.mlp.up_proj.weight")


def _duplicate(plan) -> None:
    plan.chunks[1].params.append(plan.chunks[0].params[0])


def _leave_out(plan) -> None:
    plan.chunks[0].params.pop()


def _indivisible(plan) -> None:
    plan.world_size, plan.chunk_size = 3, 4097


def _other_world_size(plan) -> None:
    plan.world_size = 2


@pytest.mark.parametrize("spoil,message", [
    (_add_missing, "does not have.*make a new plan"),
    (_duplicate, "appears twice"),
    (_leave_out, "leaves out"),
    (_indivisible, "not a positive multiple of the world size 3; round it up to 4098"),
    (_other_world_size, "world size 2 but the process group has 1"),
], ids=["missing", "duplicated", "left-out", "indivisible-chunk", "other-world-size"])
def test_a_bad_plan_is_refused_before_the_model_changes(spoil, message) -> None:
    model = make_model("llama")
    plan = hfe.ElixirPlan.simple(model, 1, chunk_size=4096)
    spoil(plan)
    snap = _snapshot(model)
    with pytest.raises(hfe.PlanError, match=message):
        hfe.ElixirModule(model, plan)
    _assert_untouched(model, snap)


def test_unsupported_optimizer() -> None:
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096))
    with pytest.raises(TypeError, match=r"for torch\.optim\.AdamW, torch\.optim\.Adam, torch\.optim\.SGD.*RMSprop"):
        hfe.ElixirOptimizer(em, torch.optim.RMSprop(model.parameters()))


def test_wrapping_twice() -> None:
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096))
    with pytest.raises(ValueError, match="already wrapped"):
        hfe.ElixirModule(model, hfe.ElixirPlan.simple(make_model("llama"), 1, chunk_size=4096))
    with pytest.raises(ValueError, match="already wrapped"):
        hfe.ElixirModule(em, em.plan)


def test_plan_made_for_a_different_model() -> None:
    model = make_model("llama")
    other = hfe.ElixirPlan.simple(make_model("qwen2"), 1, chunk_size=4096)
    snap = _snapshot(model)
    with pytest.raises(hfe.PlanError, match="another model|shapes differ"):
        hfe.ElixirModule(model, other)
    _assert_untouched(model, snap)
    # same names, other shapes: caught by the signature
    from transformers import LlamaConfig

    big = make_model("llama")
    plan = hfe.ElixirPlan.simple(big, 1, chunk_size=4096)
    cfg = LlamaConfig(**{**model.config.to_dict(), "intermediate_size": 80})
    from transformers import AutoModelForCausalLM

    wider = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(hfe.PlanError, match="shapes differ|chunk_size"):
        hfe.ElixirModule(wider, plan)


def _rcache_too_small(rank: int, world_size: int) -> str:
    from hf_elixir.runtime.fetch import RCacheTooSmall

    from tiny_models import make_dynamic_moe

    model = make_dynamic_moe()  # each MoE layer is one fetch unit spanning 3 chunks of 4096
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=4096, rcache_blocks=3)
    plan.rcache_blocks, plan.min_rcache_blocks = 2, 0  # edited past the plan-time check
    em = hfe.ElixirModule(model, plan)
    ids = make_batch(2, 8)
    with pytest.raises(RCacheTooSmall) as err:
        em(input_ids=ids, labels=ids)
    return str(err.value)


def test_rcache_too_small_says_what_to_change() -> None:
    """Refused when the plan is built, with the minimum; a plan edited past that check
    (its recorded minimum removed) still stops with advice when the runtime runs out."""
    from tiny_models import make_dynamic_moe

    model = make_dynamic_moe()
    with pytest.raises(hfe.PlanError, match="rcache_blocks >= 3"):
        hfe.ElixirPlan.simple(model, 2, chunk_size=4096, rcache_blocks=2)
    assert hfe.ElixirPlan.simple(model, 2, chunk_size=4096, rcache_blocks=3).min_rcache_blocks == 3
    # two ranks: at world size 1 chunks are gathered in place and need no rCache block
    for message in run_distributed(_rcache_too_small, 2):
        assert "more rcache_blocks" in message


def test_plan_json_round_trip() -> None:
    model = make_model("mixtral")
    plan = hfe.ElixirPlan.simple(model, 2, chunk_size=12288, offload_fraction=0.5, compute_dtype="bf16")
    again = hfe.ElixirPlan.from_json(plan.to_json())
    assert again == plan and again.digest() == plan.digest()
    data = plan.to_dict()
    data["version"] = 99
    with pytest.raises(hfe.PlanError, match="upgrade hf_elixir"):
        hfe.ElixirPlan.from_dict(data)


def test_a_backward_that_raises_leaves_the_runtime_usable() -> None:
    model = make_model("llama")
    ref = copy.deepcopy(model)
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096, rcache_blocks=3))
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    ids = make_batch(4, 16)

    def boom(grad):
        raise RuntimeError("injected failure in backward")

    handle = model.model.layers[0].mlp.up_proj.weight.register_hook(boom)
    with pytest.raises(RuntimeError, match="injected failure"):
        em(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    eopt.zero_grad()
    elixir_steps(em, eopt, [ids] * 2)
    plain_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6), [ids] * 2)
    assert em.memory_report()["current"]["grad_buffers"] == 0
    assert_state_close(ref.state_dict(), em.state_dict(), label="after a failed backward")


def _one_step(world_size: int, ids: torch.Tensor) -> tuple[torch.nn.Module, "hfe.ElixirModule"]:
    """A tiny GPT-2 wrapped by a fresh runtime, one training step taken."""
    model = make_model("gpt2")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=4096))
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-3))
    opt.backward(em(input_ids=ids, labels=ids).loss)
    opt.step()
    return model, em


def test_a_dropped_model_is_freed() -> None:
    """Gradient hooks live on the parameters, where the garbage collector cannot see
    through them; they must not keep the runtime, and with it the model, alive."""
    import gc
    import weakref

    def train_once():
        model, em = _one_step(1, make_batch(2, 8))
        return weakref.ref(model), weakref.ref(em)

    model_ref, em_ref = train_once()
    gc.collect()
    assert em_ref() is None and model_ref() is None


# ---------------------------------------------------------------------- closing a runtime
def _open_handles() -> tuple[int, int]:
    import os

    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _train_once(close: bool) -> "hfe.ElixirModule":
    _, em = _one_step(2, make_batch(4, 16))
    if close:
        em.close()
    return em


def _many_runtimes(rank: int, world_size: int) -> dict:
    closed = []
    for _ in range(4):
        em = _train_once(close=True)
        closed.append(_open_handles())
    ids = make_batch(4, 16)
    try:
        em(input_ids=ids, labels=ids)
        error = ""
    except RuntimeError as e:
        error = str(e)
    em.close()  # a second close is a no-op
    kept = [_open_handles()]
    keep_alive = [_train_once(close=False) for _ in range(2)]
    kept.append(_open_handles())
    for em in keep_alive:
        em.close()
    return {"closed": closed, "kept": kept, "error": error}


def test_closed_runtimes_leave_no_threads_or_sockets_behind() -> None:
    """A sweep builds runtime after runtime in one process: closing each gives back its
    process groups' threads and sockets; without close() each one's stay (the control)."""
    for got in run_distributed(_many_runtimes, 2):
        assert got["closed"][-1] == got["closed"][0], got["closed"]
        assert got["kept"][1][0] > got["kept"][0][0] and got["kept"][1][1] > got["kept"][0][1], got["kept"]
        assert "closed" in got["error"] and "new ElixirModule" in got["error"]


def _barrier_beside_a_pending_gather(rank: int, world_size: int) -> dict:
    """Rank 0 starts one of the runtime's gathers that rank 1 joins only after a barrier on
    the caller's group, as a prefetch the optimizer step leaves running meets a user's
    barrier or metric gather. Were the gathers on the caller's group, gloo's barrier would
    wait for the gather, which waits for rank 1, which waits in the barrier: a hang."""
    import torch.distributed as dist

    model = make_model("gpt2")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=4096))
    shard = torch.full((8,), float(rank))
    out = torch.empty(8 * world_size)
    work = em.comm.all_gather(out, shard, async_op=True) if rank == 0 else None
    dist.barrier()
    if rank == 0:
        work.wait()
    else:
        em.comm.all_gather(out, shard)
    groups = {"gather_is_callers": em.comm.gather_group is dist.group.WORLD,
              "reduce_is_callers": em.comm.reduce_group is dist.group.WORLD,
              "distinct": em.comm.gather_group is not em.comm.reduce_group}
    em.close()
    return {"gathered": out.tolist(), **groups}


def test_the_callers_collectives_do_not_wait_for_the_runtimes_gathers() -> None:
    for got in run_distributed(_barrier_beside_a_pending_gather, 2, timeout=90):
        assert got["gathered"] == [0.0] * 8 + [1.0] * 8
        assert not got["gather_is_callers"] and not got["reduce_is_callers"] and got["distinct"]
