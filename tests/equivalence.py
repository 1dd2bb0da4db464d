"""The training recipe both sides of an equivalence test run, and how results compare.

Recipe: AdamW with weight decay, a warm-up LambdaLR schedule, clipping at 1.0, a global
batch of 12 sequences, trained by the loops of tests/loops.py. The reference is plain
PyTorch in one process on the whole batch; hf_elixir splits it into 2 micro-batches
(gradient accumulation) and over the ranks.

eps is 1e-6 rather than 1e-8: Adam divides by sqrt(v) + eps, so components whose true
gradient is zero (GPT-2's attention key bias: softmax ignores a constant shift) move by
about +-lr according to float rounding noise in 1e-10-sized gradients. With eps=1e-8 the
comparison would measure that noise; with 1e-6 it measures the runtime.
"""

from __future__ import annotations

import functools

import torch

from loops import elixir_steps, plain_steps
from tiny_models import make_batch, make_dynamic_moe, make_model

GLOBAL_BATCH, SEQ, ACCUM, STEPS = 12, 16, 2, 5
LR, WD, EPS = 3e-3, 0.1, 1e-6


def build(arch: str) -> torch.nn.Module:
    return make_dynamic_moe() if arch == "dynamic_moe" else make_model(arch)


def make_optimizer(model: torch.nn.Module, kind: str = "adamw"):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=LR, eps=EPS)
    elif kind == "adam":
        opt = torch.optim.Adam(groups, lr=LR, eps=EPS, betas=(0.8, 0.95))
    elif kind == "sgd":
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)
    elif kind == "adagrad":
        opt = torch.optim.Adagrad(groups, lr=LR, lr_decay=0.01, eps=EPS)
    else:
        raise ValueError(kind)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return opt, sched


def freeze_position_embeddings(model) -> None:
    model.transformer.wpe.weight.requires_grad_(False)


def skip_second_layer_on_odd_steps(model, step: int) -> None:
    """Rank-independent control flow: the run leaves the recorded chunk order."""
    model.skip_layers = {1} if step % 2 else set()


def late_gradient_on_rank_0(emodel, rank: int) -> None:
    """Force a *late* chunk on rank 0 only: once the embedding's output gradient is computed
    (near the end of backward, after the last chunk went), hand that chunk a zero gradient
    for its first parameter. Zeros leave the result unchanged; only the collectives differ."""
    if rank != 0:
        return
    model = emodel.module
    top = emodel.chunks[-1]
    emodel.forced_late = []

    def on_embedding_grad(grad):
        emodel.forced_late.append(top.reduced)  # True: the chunk had already gone
        slot = top.slots[0]
        emodel.reducer.on_grad(top, slot, torch.zeros(slot.shape, dtype=top.dtype))
        return grad

    def hook(module, args, output):
        if output.requires_grad:
            output.register_hook(on_embedding_grad)

    model.get_input_embeddings().register_forward_hook(hook)


def extra_request_on_rank_0(emodel, rank: int) -> None:
    """In the first (recorded) pass only, rank 0 calls one block's first layer norm once
    more (a cache hit, so no collective): its recorded chunk order differs from rank 1's."""
    if rank != 0:
        return
    blocks = emodel.module.transformer.h
    fired = []

    def hook(module, args, output):
        if not fired:
            fired.append(True)
            blocks[0].ln_1(output[0])

    blocks[1].register_forward_hook(hook)


PREPARE = {"freeze_wpe": freeze_position_embeddings}
ON_STEP = {"skip_layer": skip_second_layer_on_odd_steps}
ON_WRAP = {"late_on_rank_0": late_gradient_on_rank_0, "extra_request_on_rank_0": extra_request_on_rank_0}


def rank_micro_batches(ids: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's rows of each of the ACCUM micro-batches the global batch is split into."""
    micro = len(ids) // ACCUM
    per_rank = micro // world_size
    return [ids[m * micro + rank * per_rank : m * micro + (rank + 1) * per_rank] for m in range(ACCUM)]


def reference_run(arch: str, steps: int = STEPS, prepare: str | None = None, opt_kind: str = "adamw",
                  on_step: str | None = None, device: str = "cpu") -> dict:
    """Plain PyTorch in one process on the whole batch: losses and final state."""
    torch.manual_seed(0)
    model = build(arch).to(device)
    if prepare:
        PREPARE[prepare](model)
    opt, sched = make_optimizer(model, opt_kind)
    ids = make_batch(GLOBAL_BATCH, SEQ).to(device)
    each_step = functools.partial(ON_STEP[on_step], model) if on_step else None
    losses = plain_steps(model, opt, [ids] * steps, clip=1.0, scheduler=sched, each_step=each_step)
    return {"losses": losses, "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


def elixir_run(rank: int, world_size: int, arch: str, plan_kwargs: dict | None = None, steps: int = STEPS,
               prepare: str | None = None, opt_kind: str = "adamw", on_step: str | None = None,
               plan_json: str | None = None, on_wrap: str | None = None, device: str | None = None) -> dict:
    """One rank of the hf_elixir side, with ``ElixirPlan.simple(**plan_kwargs)`` or the plan
    in ``plan_json``, computing on ``device`` (default: the wrapper's choice); the batch
    stays on the host (the wrapper moves it). Returns losses, final full state and memory
    report."""
    import hf_elixir as hfe

    torch.manual_seed(0)
    model = build(arch)
    if prepare:
        PREPARE[prepare](model)
    opt, sched = make_optimizer(model, opt_kind)
    if plan_json is not None:
        plan = hfe.ElixirPlan.from_json(plan_json)
    else:
        plan = hfe.ElixirPlan.simple(model, world_size, **(plan_kwargs or {}))
    emodel = hfe.ElixirModule(model, plan, device=device)
    if on_wrap:
        ON_WRAP[on_wrap](emodel, rank)
    eopt = hfe.ElixirOptimizer(emodel, opt)
    rows = rank_micro_batches(make_batch(GLOBAL_BATCH, SEQ), rank, world_size)
    each_step = functools.partial(ON_STEP[on_step], model) if on_step else None
    losses = elixir_steps(emodel, eopt, rows * steps, clip=1.0, scheduler=sched, accumulate=ACCUM,
                          each_step=each_step)
    state = emodel.state_dict()
    return {"losses": losses, "state": state if rank == 0 else None,
            "memory": emodel.memory_report(), "n_chunks": plan.n_chunks,
            "forced_late": getattr(emodel, "forced_late", [])}


def assert_matches(ref: dict, got: dict, rtol: float = 1e-5, atol: float = 3e-8, label: str = "") -> None:
    """Losses within ``rtol``; each weight tensor within ``rtol`` of its norm, plus ``atol``
    per element (RMS) for tensors that are pure rounding noise: a parameter whose gradient
    is identically zero, like OPT's zero-initialised key bias, holds values of ~1e-8."""
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(a - b) <= rtol * abs(a), f"{label} step {step}: loss {b} != reference {a}"
    assert_state_close(ref["state"], got["state"], rtol, atol, label)


def assert_state_close(want_state: dict, have_state: dict, rtol: float = 1e-5, atol: float = 3e-8,
                       label: str = "") -> None:
    """Each tensor within ``rtol`` of its norm (plus ``atol`` RMS, see assert_matches)."""
    assert set(want_state) == set(have_state), f"{label}: state_dict keys differ"
    for key, want in want_state.items():
        have = have_state[key]
        assert have.shape == want.shape, f"{label} {key}: shape {have.shape} != {want.shape}"
        diff = (have.float() - want.float()).norm().item()
        bound = rtol * want.float().norm().item() + atol * want.numel() ** 0.5
        assert diff <= bound, f"{label} {key}: |diff| {diff:.2e} > {bound:.2e} (norm {want.norm():.2e})"


PLANS = {
    "a_all_device": dict(chunk_size=4096, rcache_blocks=None),
    "b_rcache2": dict(chunk_size=4096, rcache_blocks=2),
    "c_half_optim_cpu": dict(chunk_size=4096, offload_fraction=0.5),
    "d_all_cpu": dict(chunk_size=4096, offload_fraction=1.0, offload_params=True),
    "e_checkpointing": dict(chunk_size=4096, activation_checkpointing=True),
}


def chunk_size_for(model) -> int:
    return max(p.numel() for p in model.parameters())
