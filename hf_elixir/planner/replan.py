"""Re-planning after an out-of-memory error: a plan that needs less memory on the device and
keeps the packing, so the runtime can move to it without moving a single shard.

The levers that need no re-packing are the ones that hold transient memory: activation
checkpointing (the activations of every block but one are recomputed in backward), the
rCache (fewer gathered chunks held at once) and prefetching (a prefetched chunk holds a
block before it is needed). ``tighten`` pulls them in the order that costs the least time
for the most memory: checkpointing first (activations dominate a step's transient memory
at training batch sizes), then the rCache, halved towards its minimum, then prefetching.
Offloading more state, or a smaller micro-batch, are the planner's and the integration's
levers and need a re-pack or a new data split.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from hf_elixir.planner.record import ElixirPlan


def tighten(plan: ElixirPlan, can_checkpoint: bool) -> Optional[ElixirPlan]:
    """The next plan down the ladder, with ``predictions["recovery"]`` saying what changed;
    None when every lever is already pulled."""
    if can_checkpoint and not plan.activation_checkpointing:
        return _changed(plan, "activation checkpointing on", activation_checkpointing=True)
    floor = max(plan.min_rcache_blocks, 1)
    if plan.rcache_blocks > floor:
        blocks = max(floor, plan.rcache_blocks // 2)
        return _changed(plan, f"rCache {plan.rcache_blocks} -> {blocks} blocks", rcache_blocks=blocks)
    if plan.prefetch_depth > 0:
        return _changed(plan, f"prefetch depth {plan.prefetch_depth} -> 0", prefetch_depth=0)
    return None


def _changed(plan: ElixirPlan, what: str, **changes) -> ElixirPlan:
    """The plan with ``changes``. Its predicted figures no longer hold, so they are kept
    only as the figures of the first plan, before any recovery."""
    first = plan.predictions.get("before_recovery") or {
        k: plan.predictions[k] for k in ("peak_bytes", "step_time", "budget_bytes") if k in plan.predictions}
    predictions = {"recovery": what, "before_recovery": first}
    return replace(plan, predictions=predictions, alternatives=[], **changes)


def same_packing(a: ElixirPlan, b: ElixirPlan) -> bool:
    """Whether ``b`` holds every parameter where ``a`` does (chunks, sizes, placements)."""
    return (a.world_size == b.world_size and a.chunk_size == b.chunk_size and a.compute_dtype == b.compute_dtype
            and [(c.params, c.param_placement, c.optim_placement, c.frozen) for c in a.chunks]
            == [(c.params, c.param_placement, c.optim_placement, c.frozen) for c in b.chunks])
