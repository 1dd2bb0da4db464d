"""One pair of ranks trains every causal-LM architecture, plainly and through hf_elixir.

Per architecture, both ranks build the same tiny model. Rank 0 trains it plainly on the
whole batch (the reference); meanwhile rank 1 trains it plainly with the batch split in
two halves whose gradients are averaged, as two data-parallel ranks would (the *spread*:
how far plain PyTorch itself strays when only the rounding order changes). Then both
ranks train it through hf_elixir, each on its half. Rank 0 compares: hf_elixir must not
stray from the reference more than ``FACTOR`` times the spread (see ``verdict``).

Starting the ranks costs seconds, so one spawned pair runs the whole list.
"""

from __future__ import annotations

import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from arch_configs import NotSmall, Skip, build_tiny, make_ids

BATCH, SEQ, STEPS = 4, 16, 3
LR, CLIP = 1e-3, 1.0
FACTOR = 5.0       # hf_elixir may stray this many times further than plain PyTorch's spread
FLOOR = 1e-5       # ... plus this much (of the distance training moved), for runs whose spread is ~0


def _train_plain(model: torch.nn.Module, ids: torch.Tensor, splits: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for rows in ids.chunk(splits):
            loss = model(input_ids=rows, labels=rows).loss / splits
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def _train_elixir(model: torch.nn.Module, ids: torch.Tensor, rank: int, group) -> tuple[list[float], dict]:
    import hf_elixir as hfe

    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plan = hfe.ElixirPlan.simple(model, 2, chunk_size=max(1024, n_params // 8), offload_fraction=0.5,
                                 example_batch=(BATCH // 2, SEQ))
    plan.rcache_blocks = plan.min_rcache_blocks  # the fewest blocks it accepts
    emodel = hfe.ElixirModule(model, plan, process_group=group)
    eopt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=LR))
    rows = ids.chunk(2)[rank]
    losses = []
    for _ in range(STEPS):
        loss = emodel(input_ids=rows, labels=rows).loss
        eopt.backward(loss)
        eopt.clip_grad_norm_(CLIP)
        eopt.step()
        eopt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / 2)
    info = {"n_chunks": plan.n_chunks, "rcache_blocks": plan.rcache_blocks, "borrowed": plan.borrowed,
            "oversized": sum(c.numel > plan.chunk_size for c in plan.chunks)}
    return losses, {"state": emodel.state_dict(), "info": info}


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([v.detach().float().reshape(-1) for _, v in sorted(state.items())])


def verdict(start: torch.Tensor, ref: torch.Tensor, spread: torch.Tensor, got: torch.Tensor,
            ref_losses: list[float], spread_losses: list[float], got_losses: list[float]) -> dict:
    """Distances from the reference, as a fraction of how far training moved the weights
    (and of the loss), for plain PyTorch's spread and for hf_elixir; ``ok`` when hf_elixir's
    are within FACTOR times the spread's plus FLOOR."""
    moved = (ref - start).norm().item() or 1.0
    d_spread = (spread - ref).norm().item() / moved
    d_got = (got - ref).norm().item() / moved
    scale = max(abs(x) for x in ref_losses) or 1.0
    l_spread = max(abs(a - b) for a, b in zip(ref_losses, spread_losses)) / scale
    l_got = max(abs(a - b) for a, b in zip(ref_losses, got_losses)) / scale
    ok = d_got <= FACTOR * d_spread + FLOOR and l_got <= FACTOR * l_spread + FLOOR
    return {"ok": ok, "weights": (d_got, d_spread), "loss": (l_got, l_spread)}


def _agree(flag: bool, group) -> bool:
    """True when the flag is true on every rank."""
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _one(rank: int, model_type: str) -> dict:
    # a group of its own with a short timeout: a rank that fails inside a collective
    # costs this architecture, not the whole sweep
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    try:
        return _compare(rank, model_type, group)
    finally:
        dist.destroy_process_group(group)


def _compare(rank: int, model_type: str, group) -> dict:
    started = time.perf_counter()
    threads = torch.get_num_threads()  # model code of an earlier architecture may change it
    torch.set_num_threads(1)
    model = build_tiny(model_type)
    if isinstance(model, Skip):
        return {"status": "skip", "reason": model.reason}
    if isinstance(model, NotSmall):
        return {"status": "fail", "reason": f"tiny config not small: {model.reason}"}
    start = _flat(model.state_dict())
    ids = make_ids(BATCH, SEQ)
    plain = build_tiny(model_type)  # same seed: the same weights
    try:
        plain_losses = _train_plain(plain, ids, splits=1 if rank == 0 else 2)
        plain_ok, plain_error = True, ""
    except Exception as exc:
        plain_ok, plain_error = False, f"{type(exc).__name__}: {str(exc)[:160]}"
    if not _agree(plain_ok, group):
        return {"status": "skip", "reason": f"plain PyTorch fails to train it: {plain_error or 'on the other rank'}"}
    try:
        got_losses, got = _train_elixir(model, ids, rank, group)
        elixir_ok, error = True, ""
    except Exception:
        elixir_ok, error = False, traceback.format_exc(limit=6)
    if not _agree(elixir_ok, group):
        return {"status": "fail", "reason": error or "failed on the other rank"}
    spread = _flat(plain.state_dict())
    dist.broadcast(spread, src=1, group=group)  # rank 1's split run, for rank 0 to compare
    spread_losses = torch.tensor(plain_losses, dtype=torch.float64)
    dist.broadcast(spread_losses, src=1, group=group)
    out = {"status": "ran", "seconds": time.perf_counter() - started, "info": got["info"], "threads": threads}
    if rank == 0:
        out.update(verdict(start, _flat(plain.state_dict()), spread, _flat(got["state"]),
                           plain_losses, spread_losses.tolist(), got_losses))
    return out


def sweep(rank: int, world_size: int, model_types: list[str]) -> dict:
    """Rank ``rank``'s outcome for every model type (rank 0's carries the verdicts)."""
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    return {mt: _one(rank, mt) for mt in model_types}
