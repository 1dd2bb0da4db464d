"""Re-planning after an out-of-memory error: a plan that needs less memory on the device and
keeps the packing, so the runtime can move to it without moving a single shard.

The levers that need no re-packing are the ones that hold transient memory: activation
checkpointing (the activations of every block but one are recomputed in backward), the
micro-batch (each batch the script hands the model run as two or more smaller ones, the
global batch unchanged; only an integration that can split batches offers it), the rCache
(fewer gathered chunks held at once) and prefetching (a prefetched chunk holds a block
before it is needed).

A searched plan carries every combination of these levers the search priced for its
packing (``recovery_options``, written by ``search.plan``), each with the cost model's
predicted peak and step time; ``tighten`` takes the fastest one whose predicted peak is
under the memory target, or, when none is, the one that needs the least. A plan without them (``ElixirPlan.simple``, a plan file) falls back
to a fixed ladder: checkpointing first (activations dominate a step's transient memory at
training batch sizes), then the micro-batch halved, then the rCache halved towards its
minimum, then prefetching off. Offloading more state is the search's lever and needs a
re-pack.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from hf_elixir.planner.record import ElixirPlan

#: each failure asks for a plan predicted to need this much less of the failed plan's peak
#: than the previous failure did (5%, then 10%, ...): the prediction was wrong once already
MARGIN_STEP = 0.05
#: micro-batch splits priced for a recovery (of the batch the plan was searched for)
SPLITS = (1, 2, 4, 8)
#: options kept in a plan (the cheapest for each memory level)
MAX_OPTIONS = 32

#: ``can_split(k)``: whether the integration can run each batch as ``k`` micro-batches
SplitCheck = Callable[[int], bool]


def memory_target(plan: ElixirPlan, attempt: int, available: Optional[float] = None) -> Optional[float]:
    """The predicted peak a plan must come under after failure number ``attempt``: the
    failed plan's predicted peak, or the memory the device could give this process when it
    failed (``available``, measured on a GPU) when that is less, less a margin that grows
    with each failure. None when the plan has no predicted peak."""
    peak = plan.predictions.get("peak_bytes")
    if not peak:
        return None
    base = min(peak, available) if available else peak
    return base * max(0.0, 1.0 - MARGIN_STEP * attempt)


def tighten(plan: ElixirPlan, can_checkpoint: bool, can_split: Optional[SplitCheck] = None,
            target: Optional[float] = None) -> Optional[ElixirPlan]:
    """The plan to move to, with ``predictions["recovery"]`` saying what changed: for a plan
    with priced options, the fastest predicted under ``target`` or, when none is, the one that
    needs the least memory. None when no lever is left (no option needs less than the plan)."""
    options = plan.predictions.get("recovery_options")
    if options:
        return _cheapest_under(plan, options, can_checkpoint, can_split, target)
    if can_checkpoint and not plan.activation_checkpointing:
        return _changed(plan, activation_checkpointing=True)
    split = plan.micro_batch_split * 2
    if can_split is not None and can_split(split):
        return _changed(plan, micro_batch_split=split)
    floor = max(plan.min_rcache_blocks, 1)
    if plan.rcache_blocks > floor:
        return _changed(plan, rcache_blocks=max(floor, plan.rcache_blocks // 2))
    if plan.prefetch_depth > 0:
        return _changed(plan, prefetch_depth=0)
    return None


def _cheapest_under(plan: ElixirPlan, options: Sequence[dict[str, Any]], can_checkpoint: bool,
                    can_split: Optional[SplitCheck], target: Optional[float]) -> Optional[ElixirPlan]:
    peak = plan.predictions.get("peak_bytes") or float("inf")
    limit = target if target is not None else peak * (1.0 - MARGIN_STEP)
    usable = [
        o for o in options
        if o["peak_bytes"] < peak and o["rcache_blocks"] >= max(plan.min_rcache_blocks, 1)
        and (can_checkpoint or o["activation_checkpointing"] == plan.activation_checkpointing)
        and (o["micro_batch_split"] == plan.micro_batch_split
             or (can_split is not None and can_split(o["micro_batch_split"])))
    ]
    if not usable:
        return None
    under = [o for o in usable if o["peak_bytes"] <= limit]
    # none predicted under the target: the least memory this packing can run in (the
    # prediction was wrong once; only a re-pack could do better, which this is not)
    best = (min(under, key=lambda o: (o["step_time_s"], o["peak_bytes"])) if under
            else min(usable, key=lambda o: (o["peak_bytes"], o["step_time_s"])))
    return _changed(plan, priced=best, activation_checkpointing=best["activation_checkpointing"],
                    rcache_blocks=best["rcache_blocks"], prefetch_depth=best["prefetch_depth"],
                    micro_batch_split=best["micro_batch_split"])


def _changed(plan: ElixirPlan, priced: Optional[dict[str, Any]] = None, **changes: Any) -> ElixirPlan:
    """The plan with ``changes``. Its predicted breakdown no longer holds: what is kept is the
    new peak and step time when the option was priced, the options and the smallest memory
    (they hold for the same packing), and the first plan's figures, before any recovery."""
    p = plan.predictions
    first = p.get("before_recovery") or {k: p[k] for k in ("peak_bytes", "step_time_s", "budget_bytes") if k in p}
    predictions: dict[str, Any] = {"recovery": describe_change(plan, changes), "before_recovery": first}
    for key in ("recovery_options", "smallest_peak_bytes", "smallest_peak_bytes_batch_1", "batch_size", "seq_len"):
        if key in p:
            predictions[key] = p[key]
    if priced is not None:
        predictions["peak_bytes"] = priced["peak_bytes"]
        predictions["step_time_s"] = priced["step_time_s"]
    return replace(plan, predictions=predictions, alternatives=[], **changes)


def describe_change(plan: ElixirPlan, changes: dict[str, Any]) -> str:
    """What a re-plan changes, in words ("activation checkpointing on, rCache 4 -> 2 blocks")."""
    said = []
    if changes.get("activation_checkpointing", plan.activation_checkpointing) != plan.activation_checkpointing:
        said.append(f"activation checkpointing {'on' if changes['activation_checkpointing'] else 'off'}")
    split = changes.get("micro_batch_split", plan.micro_batch_split)
    if split != plan.micro_batch_split:
        said.append(f"micro-batch split {plan.micro_batch_split} -> {split} (the same global batch)")
    if changes.get("rcache_blocks", plan.rcache_blocks) != plan.rcache_blocks:
        said.append(f"rCache {plan.rcache_blocks} -> {changes['rcache_blocks']} blocks")
    if changes.get("prefetch_depth", plan.prefetch_depth) != plan.prefetch_depth:
        said.append(f"prefetch depth {plan.prefetch_depth} -> {changes['prefetch_depth']}")
    return ", ".join(said) or "no change"


def with_split(plan: ElixirPlan, split: int) -> ElixirPlan:
    """``plan`` (searched for one micro-batch) run with each batch split into ``split`` of them:
    its recovery options' splits, relative to the searched micro-batch, become absolute."""
    options = [dict(o, micro_batch_split=o["micro_batch_split"] * split)
               for o in plan.predictions.get("recovery_options", [])]
    predictions = dict(plan.predictions, recovery_options=options)
    return replace(plan, micro_batch_split=split, predictions=predictions)


def same_packing(a: ElixirPlan, b: ElixirPlan) -> bool:
    """Whether ``b`` holds every parameter where ``a`` does (chunks, sizes, placements)."""
    return (a.world_size == b.world_size and a.chunk_size == b.chunk_size and a.compute_dtype == b.compute_dtype
            and [(c.params, c.param_placement, c.optim_placement, c.frozen) for c in a.chunks]
            == [(c.params, c.param_placement, c.optim_placement, c.frozen) for c in b.chunks])
