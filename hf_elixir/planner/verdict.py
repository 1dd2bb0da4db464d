"""What the search says besides its choice: the runners-up, each with why it lost, and, when
nothing fits, the smallest memory that would and the largest batch that fits."""

from __future__ import annotations

import math
from typing import Any

from hf_elixir.hardware import HardwareProfile
from hf_elixir.planner import cost
from hf_elixir.planner.candidate import OFFLOAD_MARGIN, Candidate, config_label, signature
from hf_elixir.planner.record import PlanError
from hf_elixir.profile.profiler import ModelProfile
from hf_elixir.vocab import format_bytes


def alternatives(best: Candidate, cands: list[Candidate], path: list[Candidate], budget: float,
                  limit: int) -> list[dict[str, Any]]:
    """The best few losers, one per distinct reason, each with why it lost."""
    out: list[dict[str, Any]] = []
    seen: set[tuple] = {signature(best)}

    def add(c: Candidate, reason: str) -> None:
        sig = signature(c)
        if sig in seen or len(out) >= limit:
            return
        seen.add(sig)
        d = c.describe()
        d["reason"] = reason
        out.append(d)

    by_time = sorted(cands, key=Candidate.key)
    # the fastest candidates that do not fit
    for c in by_time:
        if c.peak > budget and c.key() < best.key():
            add(c, f"does not fit: needs {format_bytes(c.peak)} > budget {format_bytes(budget)}")
            break
    # the other setting of activation checkpointing, and the other offload regime
    for pred, why in (
        (lambda c: c.checkpointing != best.checkpointing and c.peak <= budget, "slower"),
        (lambda c: (c.n_optim_cpu > 0) != (best.n_optim_cpu > 0) and c.peak <= budget, "slower"),
        (lambda c: (c.n_frozen_cpu > 0) != (best.n_frozen_cpu > 0) and c.peak <= budget, "slower"),
        (lambda c: c.rcache_blocks != best.rcache_blocks and c.peak <= budget, "slower"),
        (lambda c: c.chunk_size != best.chunk_size and c.peak <= budget, "slower"),
    ):
        for c in by_time:
            if pred(c):
                if c.key() < best.key():
                    add(c, "faster but offloads more than a plan that needs less memory")
                elif c.step_time <= best.step_time * 1.0005 and c.key()[0] > best.key()[0]:
                    add(c, f"same predicted time but offloads (offloading must win by {OFFLOAD_MARGIN:.0%})")
                elif c.step_time <= best.step_time * 1.0005:
                    add(c, "same predicted time but more bytes communicated or more memory")
                else:
                    add(c, f"{why}: predicted {c.step_time:.4g} s vs {best.step_time:.4g} s")
                break
    for c in by_time:
        if c.peak > budget:
            add(c, f"does not fit: needs {format_bytes(c.peak)} > budget {format_bytes(budget)}")
            break
    return out


def infeasible(profile: ModelProfile, model, example_batch, cands: list[Candidate], budget: float,
                hw: HardwareProfile, W: int, dtype: str, optimizer: str) -> PlanError:
    smallest = min(cands, key=lambda c: c.peak)
    max_batch = _largest_batch(profile, model, cands, budget, hw, W, dtype)
    batch_msg = (f"the largest per-device batch size that fits {format_bytes(budget)} is {max_batch} "
                 f"(at sequence length {profile.seq_len})" if max_batch >= 1 else
                 f"even batch size 1 does not fit {format_bytes(budget)} at sequence length "
                 f"{profile.seq_len}")
    frozen = f" + {profile.n_frozen_params / 1e6:.1f}M frozen" if profile.n_frozen_params else ""
    err = PlanError(
        f"no plan fits: {profile.model_name} ({profile.n_params / 1e6:.1f}M trainable{frozen} parameters, "
        f"{dtype}, {optimizer}, batch {profile.batch_size} x {profile.seq_len} per device, "
        f"world size {W}) needs at least {format_bytes(smallest.peak)} per device "
        f"(smallest plan: {config_label(smallest)}), but the budget is {format_bytes(budget)}. "
        f"{batch_msg}. Use a smaller batch size or sequence length, more GPUs, or GPUs with "
        f"more memory."
    )
    err.min_memory = int(math.ceil(smallest.peak))  # type: ignore[attr-defined]
    err.max_batch_size = max_batch  # type: ignore[attr-defined]
    return err


def _largest_batch(profile: ModelProfile, model, cands: list[Candidate], budget: float,
                   hw: HardwareProfile, W: int, dtype: str) -> int:
    """Largest per-device batch size that fits, scaling activations linearly with batch size.

    Activations and temporaries are linear in the batch size for a fixed sequence length,
    so the profiled peak scales by b / profiled_batch; the allocator margin scales with it.
    """
    B = profile.batch_size
    best = 0
    for c in cands:
        act = c.memory["activations"]
        rest = c.peak - c.memory["margin"] - act
        frac = cost.allocator_margin(hw)
        ctx = c.memory["margin"] - frac * (rest + act)
        room = (budget - ctx) / (1 + frac) - rest
        if room <= 0 or act <= 0:
            continue
        best = max(best, int(room / (act / B)))
    return best
