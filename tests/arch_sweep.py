"""One pair of ranks trains every causal-LM architecture, plainly and through hf_elixir.

Per architecture, both ranks build the same tiny model. Rank 0 trains it plainly on the
whole batch (the reference); meanwhile rank 1 trains it plainly with the batch split in
two halves whose gradients are averaged, as two data-parallel ranks would (the *spread*:
how far plain PyTorch itself strays when only the rounding order changes). Then both
ranks train it through hf_elixir, each on its half. Last, the ranks train the *twin*
together: plain PyTorch on the split batch, each rank backward on its half and the two
halves' gradients summed between them (``split_across``: the very sum one process makes
by accumulating them), with an identity view (``x.view_as(x)``) in front of every
module whose inputs hf_elixir's hooks alias (``hf_elixir.profile.grad_marks``). The views change
no value, only how autograd groups the sum of a gradient: a tensor read by a module and by
the code around it (the residual stream entering a norm) gets the module's share summed
first, then the rest. That grouping is the one hf_elixir computes, so the twin is plain
PyTorch doing hf_elixir's arithmetic, and it is a second sample of plain PyTorch's own
spread (on lfm2 the twin alone lands 9x further from the reference than the split does).

Rank 0 compares (see ``verdict``): hf_elixir must not stray from the reference more than
``FACTOR`` times plain PyTorch's spread, nor from its twin more than ``FACTOR`` times the
split's distance (in practice it lands at 0 to 0.6 of it: the twin does its arithmetic).

Starting the ranks costs seconds, so one spawned pair runs the whole list. Besides model
types, the list may name cases an issue reported (``arch_configs.CASES``): trained the same
way on the issue's own model, token ids and packing (``chunk_size``).
"""

from __future__ import annotations

import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from arch_configs import CASES, SEQ, NotSmall, Skip, build_tiny, make_ids
from loops import elixir_steps, gathered_gradients, plain_steps

BATCH, STEPS = 4, 3
LR, CLIP = 1e-3, 1.0
FACTOR = 5.0       # hf_elixir may stray this many times further than plain PyTorch's spread
FLOOR = 1e-5       # ... plus this much (of the distance training moved), for runs whose spread is ~0


def _views(obj, made: dict):
    """``obj`` with every grad-requiring tensor replaced by an identity view of it (one view
    per tensor, however often it appears); containers are rebuilt, values never change."""
    if isinstance(obj, torch.Tensor):
        if not obj.requires_grad:
            return obj
        if id(obj) not in made:
            made[id(obj)] = obj.view_as(obj)
        return made[id(obj)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_views(item, made) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_views(item, made) for item in obj)
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: _views(v, made) for k, v in obj.items()}
        for k in list(obj.keys()):  # ModelOutput and friends: updated in place
            obj[k] = _views(obj[k], made)
        return obj
    return obj


def with_input_views(model: torch.nn.Module, names: set[str]) -> torch.nn.Module:
    """``model`` with the named modules receiving identity views of their grad-requiring
    inputs, positional and keyword, as hf_elixir's hooks hand them (see the module docstring)."""
    def pre_forward(module, args, kwargs):
        made: dict = {}
        return _views(args, made), _views(kwargs, made)

    for name, module in model.named_modules():
        if name in names:
            module.register_forward_pre_hook(pre_forward, with_kwargs=True)
    return model


def _train_plain(model: torch.nn.Module, ids: torch.Tensor, splits: int, fused: bool | None = None) -> list[float]:
    """Plain PyTorch on ``ids`` in ``splits`` micro-batches (2: two ranks' halves by hand)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)
    return plain_steps(model, opt, list(ids.chunk(splits)) * STEPS, clip=CLIP, accumulate=splits, loss_fn=_loss)


def split_across(model: torch.nn.Module, ids: torch.Tensor, rank: int, group, fused: bool | None = None) -> list[float]:
    """``_train_plain(model, ids, splits=2, fused)`` with its two micro-batches on the two ranks
    of ``group``, to the bit: each rank's backward is one half's (its loss halved, as the
    accumulating loop divides it), and the halves' gradients are summed between the ranks
    before clipping. A sum of two addends is the same whichever comes first, so every rank
    holds the gradients one process gets by accumulating the halves (a parameter neither
    half reached keeps no gradient, as there), steps alike, and returns the same losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)
    params = [p for p in model.parameters() if p.requires_grad]

    def sum_halves(step: int) -> None:
        reached = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
        dist.all_reduce(reached, op=dist.ReduceOp.MAX, group=group)
        summed = [p for p, r in zip(params, reached.tolist()) if r]
        for dtype in {p.dtype for p in summed}:  # one collective per dtype
            same = [p for p in summed if p.dtype == dtype]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in same])
            dist.all_reduce(flat, group=group)
            for p, g in zip(same, flat.split([p.numel() for p in same])):
                p.grad = g.view_as(p)

    mine = plain_steps(model, opt, [ids.chunk(2)[rank]] * STEPS, clip=CLIP, after_backward=sum_halves,
                       loss_fn=lambda m, x: _loss(m, x) / 2)
    both = [torch.zeros(STEPS, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(both, torch.tensor(mine, dtype=torch.float64), group=group)
    return [0.0 + first + second for first, second in zip(both[0].tolist(), both[1].tolist())]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # by attribute, as the sweep has always read it: a model without a loss fails the same way
    return model(input_ids=ids, labels=ids).loss


def chunk_size(model_type: str, model: torch.nn.Module) -> int:
    """The sweep's chunk size: an eighth of the trainable elements (at least 1024); for a
    case an issue reported (``CASES``), the issue's: the largest parameter or a sixth of all
    elements, whichever is larger, rounded up to a multiple of the world size (2)."""
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    if model_type in CASES:
        size = max(max(sizes), sum(sizes) // 6)
        return size + size % 2
    return max(1024, sum(sizes) // 8)


def elixir_plan(model_type: str, model: torch.nn.Module):
    """The plan the sweep trains ``model`` with at world size 2: half the chunks' optimizer
    state offloaded, the fewest rCache blocks the plan accepts."""
    import hf_elixir as hfe

    plan = hfe.ElixirPlan.simple(model, 2, chunk_size=chunk_size(model_type, model), offload_fraction=0.5,
                                 example_batch=(BATCH // 2, SEQ))
    plan.rcache_blocks = plan.min_rcache_blocks  # the fewest blocks it accepts
    return plan


def _train_elixir(model_type: str, model: torch.nn.Module, ids: torch.Tensor, rank: int,
                  group) -> tuple[list[float], dict]:
    import hf_elixir as hfe

    plan = elixir_plan(model_type, model)
    emodel = hfe.ElixirModule(model, plan, process_group=group)
    eopt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=LR))
    losses = elixir_steps(emodel, eopt, [ids.chunk(2)[rank]] * STEPS, clip=CLIP, loss_fn=_loss, group=group)
    info = {"n_chunks": plan.n_chunks, "rcache_blocks": plan.rcache_blocks, "borrowed": plan.borrowed,
            "oversized": sum(c.numel > plan.chunk_size for c in plan.chunks)}
    hooked = {name for name, module in model.named_modules() if module in emodel.hooks.units}
    return losses, {"state": emodel.state_dict(), "info": info, "hooked": hooked, "runtime": emodel}


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([v.detach().float().reshape(-1) for _, v in sorted(state.items())])


def verdict(start: torch.Tensor, ref: torch.Tensor, spread: torch.Tensor, twin: torch.Tensor,
            got: torch.Tensor, ref_losses: list[float], spread_losses: list[float],
            twin_losses: list[float], got_losses: list[float]) -> dict:
    """Distances between runs, as a fraction of how far training moved the weights (and of
    the loss). Plain PyTorch's spread is the farther of its two reorderings (the split and
    the twin) from the reference. ``ok`` when hf_elixir is within FACTOR times that spread
    (plus FLOOR) of the reference, and within FACTOR times the split's distance (plus FLOOR)
    of its twin, which does the same sums in the same grouping. The twin is no closer by
    construction: the optimizer's kernel (fused in both) is the same, but the clipping norm
    is summed in another order (per chunk shard against per parameter), and Adam magnifies
    a last-bit change of a gradient near its epsilon; with expert routing a flipped choice
    carries it further."""
    moved = (ref - start).norm().item() or 1.0
    d_split = (spread - ref).norm().item() / moved
    d_twin = (twin - ref).norm().item() / moved
    d_got = (got - ref).norm().item() / moved
    d_same = (got - twin).norm().item() / moved
    scale = max(abs(x) for x in ref_losses) or 1.0

    def loss_gap(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) for x, y in zip(a, b)) / scale

    l_split, l_twin = loss_gap(ref_losses, spread_losses), loss_gap(ref_losses, twin_losses)
    l_got, l_same = loss_gap(ref_losses, got_losses), loss_gap(twin_losses, got_losses)
    d_spread, l_spread = max(d_split, d_twin), max(l_split, l_twin)
    ok = (d_got <= FACTOR * d_spread + FLOOR and l_got <= FACTOR * l_spread + FLOOR
          and d_same <= FACTOR * d_split + FLOOR and l_same <= FACTOR * l_split + FLOOR)
    return {"ok": ok, "weights": (d_got, d_spread), "loss": (l_got, l_spread),
            "twin": (d_same, d_split), "split_twin": (d_split, d_twin)}


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
    ids = make_ids(BATCH, SEQ, model_type=model_type)
    plain = build_tiny(model_type)  # same seed: the same weights
    try:
        plain_losses = _train_plain(plain, ids, splits=1 if rank == 0 else 2)
        plain_ok, plain_error = True, ""
    except Exception as exc:
        plain_ok, plain_error = False, f"{type(exc).__name__}: {str(exc)[:160]}"
    if not _agree(plain_ok, group):
        config = getattr(plain, "config", None)
        modalities = [k for k in ("vision_config", "audio_config") if getattr(config, k, None) is not None]
        kind = f"multimodal ({', '.join(modalities)}): " if modalities else ""
        return {"status": "skip", "reason": f"{kind}plain PyTorch fails to train it from input_ids alone: "
                                            f"{plain_error or 'on the other rank'}"}
    try:
        got_losses, got = _train_elixir(model_type, model, ids, rank, group)
        elixir_ok, error = True, ""
    except Exception:
        elixir_ok, error = False, traceback.format_exc(limit=6)
    if not _agree(elixir_ok, group):
        return {"status": "fail", "reason": error or "failed on the other rank"}
    # closed once both ranks trained (closing is collective): its two gloo groups' threads
    # end here, not with the process, which otherwise ran a thousand idle threads a rank by
    # the sweep's end
    got.pop("runtime").close()
    # plain PyTorch in hf_elixir's grouping (module docstring), a half on each rank
    twin = with_input_views(build_tiny(model_type), got["hooked"])
    twin_ok, twin_error = True, ""
    try:
        twin_losses = split_across(twin, ids, rank, group, fused=True)
    except Exception as exc:
        twin_ok, twin_error = False, f"{type(exc).__name__}: {str(exc)[:160]}"
    if not _agree(twin_ok, group):
        return {"status": "fail", "reason": f"plain PyTorch with identity views at the hooked modules "
                                            f"fails: {twin_error or 'on the other rank'}"}
    spread = _flat(plain.state_dict())
    spread_losses = torch.tensor(plain_losses, dtype=torch.float64)
    for t in (spread, spread_losses):  # rank 1's split run, for rank 0
        dist.broadcast(t, src=1, group=group)
    out = {"status": "ran", "seconds": time.perf_counter() - started, "info": got["info"], "threads": threads}
    if rank == 0:
        out.update(verdict(start, _flat(plain.state_dict()), spread, _flat(twin.state_dict()), _flat(got["state"]),
                           plain_losses, spread_losses.tolist(), twin_losses, got_losses))
    return out


def sweep(rank: int, world_size: int, model_types: list[str]) -> dict:
    """Rank ``rank``'s outcome for every model type (rank 0's carries the verdicts)."""
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    return {mt: _one(rank, mt) for mt in model_types}


def first_gradients(rank: int, world_size: int, model_type: str) -> dict:
    """hf_elixir's averaged gradients after one backward of the sweep's plan (each rank on
    its half of the batch), gathered whole, and the modules whose inputs its hooks alias:
    for a test that plain PyTorch in the same grouping (``twin_gradients``) gets every bit."""
    import hf_elixir as hfe

    warnings.filterwarnings("ignore")
    model = build_tiny(model_type)
    emodel = hfe.ElixirModule(model, elixir_plan(model_type, model))
    eopt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=LR))
    rows = make_ids(BATCH, SEQ, model_type=model_type).chunk(world_size)[rank]
    eopt.backward(_loss(emodel, rows))
    return gathered_gradients(emodel, model)


def split_gradients(model: torch.nn.Module, halves, loss) -> dict:
    """Plain PyTorch's gradients of ``model`` for the two ``halves`` of a batch, averaged, as
    two ranks would compute them: on one thread, as the ranks run (more threads split a
    kernel's sums differently, and a test's thread count depends on what ran before it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rows in halves:
            (loss(model, rows) / 2).backward()
    finally:
        torch.set_num_threads(threads)
    return {name: p.grad for name, p in model.named_parameters()}


def twin_gradients(model_type: str, views: set[str]) -> dict:
    """``split_gradients`` of a sweep model with identity views at the inputs of the
    ``views`` modules (none: plain PyTorch's own split)."""
    model = with_input_views(build_tiny(model_type), views)
    return split_gradients(model, make_ids(BATCH, SEQ, model_type=model_type).chunk(2), _loss)
