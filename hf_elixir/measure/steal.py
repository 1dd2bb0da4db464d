"""CPU time the hypervisor takes from a virtual machine ("steal"), as Linux counts it.

A shared VM runs slow in spells: for tens of seconds its virtual CPUs get a share of the
physical ones, and every instruction, every collective over loopback, takes longer. The
kernel counts that time per CPU (the eighth field of the ``cpu`` line of ``/proc/stat``).
A calibration taken in such a spell prices every plan too slow; a benchmark step taken in
one measures the machine's neighbours rather than the plan. ``StealMeter`` gives the share
of all CPU time stolen over an interval, so both can say what they ran under.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

_STAT = Path("/proc/stat")


def cpu_times() -> tuple[int, int] | None:
    """(stolen, total) jiffies of all CPUs since boot; None where the kernel does not say
    (not Linux, or a kernel without the steal field)."""
    try:
        first = _STAT.read_text().splitlines()[0].split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 9:
        return None
    values = [int(v) for v in first[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
    # already counted in user and nice
    return values[7], sum(values[:8])


@dataclass
class StealMeter:
    """The share of CPU time stolen since the meter started (or was last restarted)."""

    _start: tuple[int, int] | None = field(default_factory=cpu_times)

    def restart(self) -> None:
        self._start = cpu_times()

    def share(self) -> float | None:
        """Stolen over all CPU time since the start, 0..1; None where it cannot be known."""
        now = cpu_times()
        if now is None or self._start is None:
            return None
        stolen, total = now[0] - self._start[0], now[1] - self._start[1]
        return stolen / total if total > 0 else 0.0
