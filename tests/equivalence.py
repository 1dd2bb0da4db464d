"""The training recipe both sides of an equivalence test run, and how results compare.

Recipe: AdamW with weight decay, a warm-up LambdaLR schedule, clipping at 1.0, a global
batch of 12 sequences. The reference is plain PyTorch in one process on the whole batch;
hf_elixir splits it into 2 micro-batches (gradient accumulation) and over the ranks.

eps is 1e-6 rather than 1e-8: Adam divides by sqrt(v) + eps, so components whose true
gradient is zero (GPT-2's attention key bias: softmax ignores a constant shift) move by
about +-lr according to float rounding noise in 1e-10-sized gradients. With eps=1e-8 the
comparison would measure that noise; with 1e-6 it measures the runtime.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from tiny_models import make_batch, make_dynamic_moe, make_model

GLOBAL_BATCH, SEQ, ACCUM, STEPS = 12, 16, 2, 5
LR, WD, EPS = 3e-3, 0.1, 1e-6


def build(arch: str) -> torch.nn.Module:
    return make_dynamic_moe() if arch == "dynamic_moe" else make_model(arch)


def make_optimizer(model: torch.nn.Module):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, eps=EPS,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return opt, sched


def loss_of(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out["loss"]


def reference_run(arch: str, steps: int = STEPS, prepare: Callable | None = None) -> dict:
    torch.manual_seed(0)
    model = build(arch)
    if prepare:
        prepare(model)
    opt, sched = make_optimizer(model)
    ids = make_batch(GLOBAL_BATCH, SEQ)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def elixir_run(rank: int, world_size: int, arch: str, plan_kwargs: dict, steps: int = STEPS,
               prepare: Callable | None = None) -> dict:
    """One rank of the hf_elixir side. Returns losses, final full state and memory report."""
    import torch.distributed as dist

    import hf_elixir as hfe

    torch.manual_seed(0)
    model = build(arch)
    if prepare:
        prepare(model)
    opt, sched = make_optimizer(model)
    plan = hfe.ElixirPlan.simple(model, world_size, **plan_kwargs)
    emodel = hfe.ElixirModule(model, plan)
    eopt = hfe.ElixirOptimizer(emodel, opt)
    ids = make_batch(GLOBAL_BATCH, SEQ)
    micro = GLOBAL_BATCH // ACCUM
    per_rank = micro // world_size
    losses = []
    for _ in range(steps):
        total = torch.zeros(1)
        for m in range(ACCUM):
            rows = ids[m * micro + rank * per_rank : m * micro + (rank + 1) * per_rank]
            loss = loss_of(emodel, rows) / ACCUM
            eopt.backward(loss)
            total += loss.detach()
        eopt.clip_grad_norm_(1.0)
        eopt.step()
        sched.step()
        eopt.zero_grad()
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world_size)
    state = emodel.state_dict()
    return {"losses": losses, "state": state if rank == 0 else None,
            "memory": emodel.memory_report(), "n_chunks": plan.n_chunks}


def assert_matches(ref: dict, got: dict, rtol: float = 1e-5, label: str = "") -> None:
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(a - b) <= rtol * abs(a), f"{label} step {step}: loss {b} != reference {a}"
    assert set(ref["state"]) == set(got["state"]), f"{label}: state_dict keys differ"
    for key, want in ref["state"].items():
        have = got["state"][key]
        assert have.shape == want.shape, f"{label} {key}: shape {have.shape} != {want.shape}"
        err = (have.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)
        assert err <= rtol, f"{label} {key}: relative error {err:.2e} > {rtol:.0e}"


PLANS = {
    "a_all_device": dict(chunk_size=4096, rcache_blocks=None),
    "b_rcache2": dict(chunk_size=4096, rcache_blocks=2),
    "c_half_optim_cpu": dict(chunk_size=4096, offload_fraction=0.5),
    "d_all_cpu": dict(chunk_size=4096, offload_fraction=1.0, offload_params=True),
    "e_checkpointing": dict(chunk_size=4096, activation_checkpointing=True),
}


def chunk_size_for(model) -> int:
    return max(p.numel() for p in model.parameters())
