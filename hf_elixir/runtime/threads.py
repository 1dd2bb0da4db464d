"""How many threads a rank's host work may use.

``torchrun`` and ``accelerate launch`` export ``OMP_NUM_THREADS=1`` when several processes
share a machine, so a launched rank's torch runs on one thread unless told otherwise. That
suits its compute on a CPU device (the ranks share the cores), but a rank that updates
offloaded optimizer state on the host leaves the rest of its share idle: the host update is
element-wise work that scales with cores until memory bandwidth runs out. Each rank takes its
share of the cores it may run on (the launcher's local processes divide them) for that work,
and only for that work: element-wise kernels give the same result on any number of threads,
reductions (a gradient norm) may not, so nothing else changes its thread count.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

#: set to a number to choose the host update's threads (the default is the rank's share)
THREADS_ENV = "HF_ELIXIR_HOST_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), or the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def host_threads(world_size: int = 1) -> int:
    """Threads for this rank's host update: ``$HF_ELIXIR_HOST_THREADS`` if set, else the
    usable cores divided by the processes on this machine, and never fewer than torch
    already uses. The processes on this machine are the launcher's ``LOCAL_WORLD_SIZE``;
    without a launcher (ranks spawned by a script) all ``world_size`` ranks are taken to be
    here: every rank updates at the same moment of the step, so a rank that took all the
    cores would run its threads over the others' (it cost 1.3% to 2.5% a step at world
    size 2 on 2 cores: ``docs/benchmarks.md``, bench_tree_ab), while one that takes too few
    only updates slower."""
    chosen = os.environ.get(THREADS_ENV)
    if chosen:
        try:
            value = int(chosen)
        except ValueError:
            raise ValueError(f"{THREADS_ENV} must be a whole number of threads, got {chosen!r}") from None
        if value < 1:
            raise ValueError(f"{THREADS_ENV} must be at least 1, got {value}")
        return value
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "") or world_size))
    return max(torch.get_num_threads(), usable_cores() // local, 1)


@contextlib.contextmanager
def using_threads(count: int) -> Iterator[None]:
    """Run the block with torch's intra-op threads set to ``count``, then restore them."""
    before = torch.get_num_threads()
    if count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
