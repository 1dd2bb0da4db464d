"""Bytes on the wire (issue 9): the runtime counts what each step moves, by kind; the
planner predicts exactly that; a counter of raw torch.distributed ops agrees.

Every case trains at world size 2 in real gloo processes. The window runs from just after
the first optimizer step (the recording pass and the trace agreement are behind it) to just
after the last, so it holds whole steady-state steps: each step's own gathers, its gradient
reductions, its small all-reduces, and the prefetch its optimizer step starts for the next.
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

import hf_elixir as hfe
from equivalence import GLOBAL_BATCH, SEQ, make_optimizer
from harness import run_distributed
from hf_elixir.planner import traffic
from hf_elixir.runtime import comm as comm_mod
from loops import elixir_steps, plain_steps
from tiny_models import make_batch, make_model

WINDOW_STEPS = 2
BATCH = (GLOBAL_BATCH // 2, SEQ)  # per rank: (batch, seq)


def _train(rank: int, world_size: int, model, plan, *, device=None, tensor_collectives: bool = False,
           wire: bool = False) -> dict:
    """Train 1 + WINDOW_STEPS steps; the runtime's counter (and, with ``wire``, a WireCounter)
    over the last WINDOW_STEPS."""
    from hf_elixir.runtime.comm_count import WireCounter

    if tensor_collectives:
        os.environ[comm_mod.COLLECTIVES_ENV] = "tensor"
    try:
        em = hfe.ElixirModule(model, plan, device=device)
    finally:
        os.environ.pop(comm_mod.COLLECTIVES_ENV, None)
    opt, _ = make_optimizer(model)
    eopt = hfe.ElixirOptimizer(em, opt)
    ids = make_batch(GLOBAL_BATCH, SEQ)[rank * BATCH[0] : (rank + 1) * BATCH[0]]
    counter = WireCounter()

    def step() -> None:  # no loss all-reduce: the counters see the step's own collectives only
        elixir_steps(em, eopt, [ids], clip=1.0, average=False)

    step()
    em.comm_report(reset=True)
    for _ in range(WINDOW_STEPS):
        if wire:
            with counter:
                step()
        else:
            step()
    return {"runtime": em.comm_report(), "wire": counter.counter.report(), "unknown": dict(counter.unknown),
            "evictions": em.memory_report()["cache_stats"]["evictions"]}


def _predict(plan, model, device_type: str, host: bool) -> dict[str, int]:
    numels = {n: p.numel() for n, p in model.named_parameters()}
    gathers = traffic.traced_gathers(plan, model, BATCH)
    return traffic.plan_traffic(plan, numels, gathers, device_type, host=host).bytes


def _tied_gpt2():
    """A GPT-2 from transformers' own config class, embedding tied to the LM head."""
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=96, n_positions=64, n_embd=48, n_layer=3, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def _simple(model, world_size: int, **kw):
    return hfe.ElixirPlan.simple(model, world_size, example_batch=BATCH, **kw)


def _minimum_plan(model, world_size: int, **kw):
    minimum = _simple(model, world_size, **kw).min_rcache_blocks
    return _simple(model, world_size, rcache_blocks=minimum, **kw)


# case -> (model, plan factory, extra _train options)
CASES = {
    "gpt2_tied_full_rcache": (_tied_gpt2, lambda m, W: _simple(m, W, chunk_size=4096), {}),
    "gpt2_tied_min_rcache": (_tied_gpt2, lambda m, W: _minimum_plan(m, W, chunk_size=4096), {}),
    "llama_optim_offload": (lambda: make_model("llama"),
                            lambda m, W: _simple(m, W, chunk_size=4096, offload_fraction=0.5), {}),
    "llama_min_rcache_tensor": (lambda: make_model("llama"), lambda m, W: _minimum_plan(m, W, chunk_size=4096),
                                {"tensor_collectives": True}),
    "llama_searched": (lambda: make_model("llama"),
                       lambda m, W: hfe.plan(m, BATCH, hardware="cpu", world_size=W, dtype="fp32"), {}),
}


def _run_cases(rank: int, world_size: int) -> dict:
    out = {}
    for name, (build, make_plan, opts) in CASES.items():
        model = build()
        plan = make_plan(model, world_size)
        host = not opts.get("tensor_collectives", False)
        predicted = _predict(plan, model, "cpu", host)
        searched = dict(plan.predictions.get("comm_bytes_by_kind", {}))
        got = _train(rank, world_size, model, plan, wire=name == "gpt2_tied_full_rcache", **opts)
        out[name] = dict(got, predicted=predicted, searched=searched, n_chunks=plan.n_chunks,
                         rcache_blocks=plan.rcache_blocks)
    return out


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_distributed(_run_cases, 2, timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_counted_bytes_per_step_equal_the_prediction(case: str) -> None:
    for rank, by_case in enumerate(results()):
        got = by_case[case]
        runtime = got["runtime"]
        assert runtime["steps"] == WINDOW_STEPS and runtime["backward_passes"] == WINDOW_STEPS
        per_step = {k: v * WINDOW_STEPS for k, v in got["predicted"].items()}
        assert runtime["bytes"] == per_step, f"rank {rank} {case}: counted {runtime['bytes']} != predicted {per_step}"
        assert runtime["bytes"]["all_gather"] > 0 and runtime["bytes"]["all_reduce"] > 0
        if case == "llama_searched":  # the search records the same prediction
            assert got["searched"] == got["predicted"]


def test_the_cases_cover_what_they_claim() -> None:
    got = results()[0]
    for case in ("gpt2_tied_min_rcache", "llama_min_rcache_tensor"):
        assert got[case]["rcache_blocks"] < got[case]["n_chunks"] and got[case]["evictions"] > 0, case
        assert sum(got[case]["predicted"].values()) > 0
    full = got["gpt2_tied_full_rcache"]
    assert full["rcache_blocks"] == full["n_chunks"] and full["evictions"] == 0
    # tensor collectives reduce-scatter; gloo's strategy all-reduces the gradients
    assert got["llama_min_rcache_tensor"]["runtime"]["bytes"]["reduce_scatter"] > 0
    assert full["runtime"]["bytes"]["reduce_scatter"] == 0


def test_a_counter_of_raw_collectives_agrees_with_the_runtime() -> None:
    """A TorchDispatchMode over the same steps sees every c10d op; the runtime's gloo gather
    is W broadcasts of one shard, so its all_gather bytes are the raw counter's broadcasts."""
    for got in results():
        full = got["gpt2_tied_full_rcache"]
        wire, runtime = full["wire"]["bytes"], full["runtime"]["bytes"]
        assert full["unknown"] == {}
        assert wire["broadcast"] + wire["all_gather"] == runtime["all_gather"] > 0
        for kind in ("reduce_scatter", "all_reduce"):
            assert wire[kind] == runtime[kind], kind


def test_the_convention() -> None:
    B, W = 1200, 3
    assert traffic.wire_bytes("all_gather", B, W) == traffic.wire_bytes("reduce_scatter", B, W) == 800
    assert traffic.wire_bytes("all_reduce", B, W) == 1600
    assert traffic.wire_bytes("broadcast", B, W) == B and traffic.wire_bytes("broadcast", B, W, source=True) == 0
    assert all(traffic.wire_bytes(k, B, 1) == 0 for k in traffic.COLLECTIVE_KINDS)


# ---------------------------------------------------------------------- the CUDA staging path
STAGED = {"optim": (dict(offload_fraction=0.5), None),
          "params": (dict(offload_fraction=1.0, offload_params=True), "cpu:0")}


def _staged(rank: int, world_size: int, case: str) -> dict:
    """Host<->device traffic as a CUDA device moves it, with the CUDA stream API replaced by
    stand-ins (test_gpu_readiness) and NCCL's collectives, in bf16 (master weights are not the
    shards). "optim": half the chunks keep their optimizer on the host (gradient shards go
    down, updated shards go up from staging). "params": every chunk's parameters and optimizer
    on the host, gathered from the host; the compute device is ``cpu:0``, which differs from
    the host shards' ``cpu``, so the runtime takes that path (as test_gpu_readiness does).
    "optim" runs at world size 2 only: at world size 1 a host gradient shard on a CPU device
    takes gradients directly (nothing to download), where a CUDA device would download them."""
    from test_gpu_readiness import _use_stand_in_streams

    _use_stand_in_streams()
    kw, device = STAGED[case]
    model = make_model("llama")
    plan = _simple(model, world_size, chunk_size=4096, compute_dtype="bf16", **kw)
    predicted = _predict(plan, model, "cuda", host=False)
    got = _train(rank, world_size, model, plan, device=device, tensor_collectives=True)
    return dict(got, predicted=predicted)


@pytest.mark.parametrize("case,world_size", [("optim", 2), ("params", 1), ("params", 2)])
def test_staged_host_copies_equal_the_prediction(case: str, world_size: int) -> None:
    for rank, got in enumerate(run_distributed(_staged, world_size, case)):
        counted = got["runtime"]["bytes"]
        assert counted == {k: v * WINDOW_STEPS for k, v in got["predicted"].items()}, rank
        assert counted["host_to_device"] > 0 and counted["device_to_host"] > 0


def _dtensor_norm(rank: int, world_size: int) -> dict:
    """What FSDP2's clipping issues: the norm of a sharded DTensor, redistributed inside
    DTensor's dispatch (out of a dispatch mode's sight), then scaling; plus a plain all-reduce."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from hf_elixir.runtime.comm_count import WireCounter

    mesh = init_device_mesh("cpu", (world_size,))
    grad = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    counter = WireCounter()
    with counter:
        norm = torch.linalg.vector_norm(grad)  # fp32 scalar, partial on each rank
        grad.mul_(1.0 / (norm + 1e-6))
        dist.all_reduce(torch.ones(10, dtype=torch.float64))
    return counter.counter.report()["bytes"]


def test_the_raw_counter_sees_collectives_issued_inside_dtensor_ops() -> None:
    for got in run_distributed(_dtensor_norm, 2):
        # the norm's all-reduce (4 bytes) and the plain one (80 bytes), each 2B(W-1)/W
        assert got["all_reduce"] == traffic.wire_bytes("all_reduce", 4, 2) + traffic.wire_bytes("all_reduce", 80, 2)


# ---------------------------------------------------------------------- against FSDP2
def _fsdp2_every_module(model) -> float:
    """FSDP2 over the embedding, each block, the (untied) head and the root, so that FSDP2
    reshards every parameter after forward but the root's own (the final norm). Returns the
    share of the parameters the root keeps gathered from forward into backward."""
    from torch.distributed.fsdp import fully_shard

    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    wrapped = [model.get_input_embeddings(), *model.model.layers, model.get_output_embeddings()]
    for module in wrapped:
        fully_shard(module)
    fully_shard(model)
    inner = sum(p.numel() for m in wrapped for p in m.parameters())
    return 1 - inner / sum(p.numel() for p in model.parameters())


def _bytes_against_fsdp2(rank: int, world_size: int) -> dict:
    """The same Llama trained 1 + WINDOW_STEPS steps by FSDP2 and by hf_elixir with every
    chunk cached (the collectives NCCL runs); each one's raw collectives counted alike."""
    from hf_elixir.runtime.comm_count import WireCounter

    model = make_model("llama")
    root_share = _fsdp2_every_module(model)
    opt, _ = make_optimizer(model)
    ids = make_batch(GLOBAL_BATCH, SEQ)[rank * BATCH[0] : (rank + 1) * BATCH[0]]
    counter = WireCounter()
    for i in range(1 + WINDOW_STEPS):
        with counter if i else contextlib.nullcontext():
            plain_steps(model, opt, [ids], clip=1.0)
    fsdp2 = counter.counter.report()["bytes"]
    model = make_model("llama")
    # chunks packed only up to the largest parameter: little padding, as a searched plan packs
    plan = _simple(model, world_size, chunk_size=max(p.numel() for p in model.parameters()))
    elixir = _train(rank, world_size, model, plan, tensor_collectives=True, wire=True)
    return {"fsdp2": fsdp2, "hf_elixir": elixir["wire"]["bytes"], "root_share": root_share,
            "full": (plan.rcache_blocks, plan.n_chunks, elixir["evictions"])}


def test_a_full_rcache_moves_two_thirds_of_what_fsdp2_moves() -> None:
    """The issue's premise, where it holds: FSDP2 gathers each resharded module twice a step
    (forward, backward) and reduce-scatters it once; hf_elixir with every chunk cached
    gathers once. FSDP2 keeps its root's own parameters gathered, so the bound is
    2 / (3 - root share): 0.667 here, where the root holds only the final norm."""
    for got in run_distributed(_bytes_against_fsdp2, 2, timeout=300):
        blocks, chunks, evictions = got["full"]
        assert blocks == chunks and evictions == 0
        fsdp2, elixir = sum(got["fsdp2"].values()), sum(got["hf_elixir"].values())
        assert got["fsdp2"]["all_gather"] > got["fsdp2"]["reduce_scatter"] > 0
        assert got["root_share"] < 0.005
        ratio = elixir / fsdp2
        assert ratio <= 2 / (3 - got["root_share"]) * 1.002, (ratio, got)
        assert ratio <= 0.67, (ratio, got)
