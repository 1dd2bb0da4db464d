"""What the search records for a recovery (``replan.tighten``): every plan the runtime could
move to in place from the chosen one, and the least memory any plan needs.

In place means the same chunks and placements, so only the transient levers vary:
activation checkpointing, the rCache, prefetching (each combination priced by the search
itself) and the micro-batch. The micro-batch is not searched (the batch is the script's); a
split of ``k`` is priced from the candidate's own figures:

- memory: activations (and the allocator margin on them) are linear in the batch at a fixed
  sequence length, so they shrink to ``1/k``; everything else stays;
- time: the compute is the same in total, but every one of the ``k`` passes gathers and
  reduces the chunks again: a pass takes ``max(compute / k, collectives)`` plus what of the
  step overlapped with neither. A GPU's lower efficiency at small batches is not priced.
"""

from __future__ import annotations

from typing import Any

from hf_elixir.planner.candidate import Candidate
from hf_elixir.planner.replan import MAX_OPTIONS, SPLITS


def split_priced(c: Candidate, k: int, allocator_fraction: float) -> tuple[float, float]:
    """(predicted peak, predicted step time) of candidate ``c`` with each batch run as ``k``
    micro-batches (see the module docstring)."""
    act = c.memory.get("activations", 0)
    peak = c.peak - act * (1 - 1 / k) * (1 + allocator_fraction)
    t = c.time
    compute, comm, fb = t.get("compute", 0.0), t.get("collectives", 0.0), t.get("forward_backward", 0.0)
    rest = max(0.0, fb - max(compute, comm))
    pass_time = max(compute / k, comm) + rest
    return peak, c.step_time - fb + k * pass_time


def recovery_options(best: Candidate, cands: list[Candidate], allocator_fraction: float,
                     batch_size: int) -> list[dict[str, Any]]:
    """The in-place plans from ``best`` that need less memory, the cheapest per memory level:
    walking up from the smallest peak, an option is kept only when it is faster than every
    smaller one kept (the others are never the right choice for any memory target). The
    same walk over the unsplit options alone is kept too, for a runtime that cannot split."""
    same = [c for c in cands if c.chunk_size == best.chunk_size and c.n_optim_cpu == best.n_optim_cpu
            and c.n_param_cpu == best.n_param_cpu and c.n_frozen_cpu == best.n_frozen_cpu
            and not c.policies and not c.logit_piece_tokens and c.mlp_tiles == 1]
    priced: dict[tuple, dict[str, Any]] = {}
    for c in same:
        for k in SPLITS:
            if k > batch_size or batch_size % k:
                continue
            peak, step = split_priced(c, k, allocator_fraction)
            if peak >= best.peak:
                continue
            key = (c.checkpointing, c.rcache_blocks, c.prefetch_depth, k)
            if key not in priced or step < priced[key]["step_time_s"]:
                priced[key] = {"activation_checkpointing": c.checkpointing, "rcache_blocks": c.rcache_blocks,
                               "prefetch_depth": c.prefetch_depth, "micro_batch_split": k,
                               "peak_bytes": int(peak), "step_time_s": step}
    # a runtime whose integration cannot split batches chooses among the unsplit ones only:
    # their own front is kept too
    unsplit = _front([o for o in priced.values() if o["micro_batch_split"] == 1])
    every = _front(list(priced.values()))
    kept = {id(o): o for o in [*unsplit[-MAX_OPTIONS // 2:], *every[-MAX_OPTIONS // 2:]]}
    return sorted(kept.values(), key=lambda o: (o["peak_bytes"], o["step_time_s"]))


def _front(options: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Walking up from the smallest peak, the options faster than every smaller one."""
    front: list[dict[str, Any]] = []
    for o in sorted(options, key=lambda o: (o["peak_bytes"], o["step_time_s"])):
        if not front or o["step_time_s"] < front[-1]["step_time_s"]:
            front.append(o)
    return front


def smallest_peaks(cands: list[Candidate], allocator_fraction: float, batch_size: int) -> dict[str, int]:
    """The least memory per device any candidate needs (any packing, any offload), at the
    searched batch and at batch 1 (activations scaled down linearly)."""
    if not cands:
        return {}
    at_batch = min(c.peak for c in cands)
    at_one = min(split_priced(c, batch_size, allocator_fraction)[0] for c in cands) if batch_size > 1 else at_batch
    return {"smallest_peak_bytes": int(at_batch), "smallest_peak_bytes_batch_1": int(at_one)}
