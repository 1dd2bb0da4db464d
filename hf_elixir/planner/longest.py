"""The longest sequence that fits: a search over sequence lengths, each probe a whole plan.

``hf-elixir plan --seq-len max`` asks it. Whether a sequence length fits is what the plan
search says at that length (a fresh profile and search: nothing is scaled or assumed), so
the answer is a plan like any other. Probes cost a profile and a search each, so they are
few: between the longest length known to fit and the shortest known not to, the next probe
is where the smallest predicted peak (``smallest_peak_bytes``, or the error's
``min_memory``) would meet the budget, interpolated linearly between the two nearest probes
(activations grow about linearly with the sequence once attention is a fused kernel), and
the midpoint when that says nothing new. Lengths are multiples of ``granule`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from hf_elixir.planner.record import ElixirPlan, PlanError

#: lengths probed are multiples of this many tokens
GRANULE = 1024
#: the first length probed
START = 8192
#: no length beyond this is probed (a million tokens)
LIMIT = 1 << 20


@dataclass
class Probe:
    """One plan made at one sequence length: whether it fits, the least memory any plan
    there needs (None when the search could not say), and the plan when it fits."""

    seq_len: int
    fits: bool
    smallest_peak: float | None
    plan: ElixirPlan | None = None
    error: str = ""


@dataclass
class Longest:
    """The answer: the longest length that fits (its probe; None when not even one granule
    fits), the shortest known not to (None when the limit fits) and every probe made."""

    best: Probe | None
    beyond: Probe | None
    probes: list[Probe] = field(default_factory=list)


def probe_with(make_plan: Callable[[int], ElixirPlan]) -> Callable[[int], Probe]:
    """A prober from a function that plans at a sequence length (raising ``PlanError`` when
    nothing fits)."""
    def probe(seq_len: int) -> Probe:
        try:
            plan = make_plan(seq_len)
        except PlanError as e:
            smallest = getattr(e, "min_memory", None)
            return Probe(seq_len, False, float(smallest) if smallest is not None else None, error=str(e))
        smallest = plan.predictions.get("smallest_peak_bytes", plan.predictions.get("peak_bytes"))
        return Probe(seq_len, True, float(smallest) if smallest is not None else None, plan)
    return probe


def longest_sequence(probe: Callable[[int], Probe], budget: float, granule: int = GRANULE,
                     start: int = START, limit: int = LIMIT) -> Longest:
    """The longest multiple of ``granule`` up to ``limit`` whose plan fits ``budget``
    (see the module docstring)."""
    if granule < 1 or start < granule or limit < start:
        raise ValueError(f"need 1 <= granule <= start <= limit, got {granule}, {start}, {limit}")
    start -= start % granule
    probes: dict[int, Probe] = {}

    def at(s: int) -> Probe:
        if s not in probes:
            probes[s] = probe(s)
        return probes[s]

    def guess(a: Probe, b: Probe) -> float | None:
        """Where the smallest peak meets the budget on the line through two probes."""
        if a.smallest_peak is None or b.smallest_peak is None or a.smallest_peak == b.smallest_peak:
            return None
        slope = (b.smallest_peak - a.smallest_peak) / (b.seq_len - a.seq_len)
        if slope <= 0:
            return None
        return a.seq_len + (budget - a.smallest_peak) / slope

    lo: Probe | None = None
    hi: Probe | None = None
    p = at(start)
    (lo, hi) = (p, None) if p.fits else (None, p)
    # bracket: grow from a fit, shrink from a miss
    while lo is None or hi is None:
        known = sorted(probes.values(), key=lambda q: q.seq_len)
        line = guess(known[-2], known[-1]) if len(known) >= 2 else None
        if lo is not None:  # everything probed fits: go longer
            if lo.seq_len >= limit:
                break
            ahead = lo.seq_len * 2 if line is None else line
            nxt = min(limit, max(lo.seq_len + granule, _down(ahead, granule)))
            nxt = min(nxt, lo.seq_len * 4)
        else:  # nothing probed fits: go shorter
            assert hi is not None
            if hi.seq_len <= granule:
                break
            behind = hi.seq_len / 2 if line is None else line
            nxt = max(granule, min(hi.seq_len - granule, _down(behind, granule)))
            nxt = max(nxt, _down(hi.seq_len / 4, granule), granule)
        q = at(nxt)
        if q.fits:
            lo = q if lo is None or q.seq_len > lo.seq_len else lo
        else:
            hi = q if hi is None or q.seq_len < hi.seq_len else hi
    # narrow the bracket to one granule; after two moves of one end in a row, halve it
    # instead (a curved peak would otherwise creep up on the answer a granule at a time)
    moved: list[bool] = []
    while lo is not None and hi is not None and hi.seq_len - lo.seq_len > granule:
        line = guess(lo, hi)
        mid = _down((lo.seq_len + hi.seq_len) / 2, granule)
        stalled = len(moved) >= 2 and moved[-1] == moved[-2]
        nxt = _down(line, granule) if line is not None and not stalled else mid
        if not lo.seq_len < nxt < hi.seq_len:
            nxt = mid if lo.seq_len < mid < hi.seq_len else lo.seq_len + granule
        q = at(nxt)
        moved.append(q.fits)
        if q.fits:
            lo = q
        else:
            hi = q
    return Longest(lo, hi, sorted(probes.values(), key=lambda q: q.seq_len))


def _down(x: float, granule: int) -> int:
    return int(x // granule) * granule


__all__ = ["GRANULE", "LIMIT", "Longest", "Probe", "START", "longest_sequence", "probe_with"]
