"""The price of one fetch event's operators on one rank: the bridge between what the trace
recorded (``profile.trace.EventWork``) and how fast the hardware runs it
(``hardware.ComputeFigures``). The cost model, the search and the measuring room all price
work through this one function, so a prediction and a measurement compare like with like.
"""

from __future__ import annotations

from hf_elixir.hardware import ComputeFigures


def price(work, figs: ComputeFigures, dtype: str, efficiency: float | None = None) -> float:
    """Seconds one ``EventWork`` takes on a rank with ``figs``."""
    t = sum(f / figs.matmul_rate(dtype, 2.0 ** (b + 0.5), layout) for (layout, b), f in work.matmul.items())
    t += work.read / figs.read_bandwidth + work.strided / figs.strided_bandwidth + work.ops * figs.op_overhead
    t += work.special / figs.special_rate
    t += sum(nb / figs.write_rate(2.0 ** (b + 0.5)) for b, nb in work.fresh.items())
    return t * (figs.efficiency if efficiency is None else efficiency)
