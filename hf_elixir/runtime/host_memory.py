"""The host heap of a CPU training process: no page faults per step, and no growth.

On a CPU device every tensor of a step lives in the process heap, and glibc's defaults cost
twice there (the measurements are in docs/gpu.md, "Host memory on a CPU device"):

- **Page faults.** glibc maps each allocation above 32 MiB afresh and unmaps it when it is
  freed, so every large tensor of every step (the logits, an embedding's gradient) faults in
  each 4 KiB page again, a system-time cost that grows with the model. Freed memory can stay
  mapped instead (``mallopt``: no ``mmap`` for large blocks, no trimming of the heap top), as
  CUDA's caching allocator keeps its blocks.
- **Fragmentation.** glibc's per-thread cache (tcache) lets small blocks freed by gloo's
  worker threads be reused there, pinning the main heap, and its free holes never fit the
  next large tensor, so the heap grows step after step while the memory in use stays flat
  (one process, or DDP, does not grow). With the cache off
  (``GLIBC_TUNABLES=glibc.malloc.tcache_count=0``, read only when a process starts) the heap
  stays flat, without page faults.

So launchers of CPU ranks (``hf-elixir launch``, the benchmarks) start them with
``TUNABLES`` (``rank_environment``); the runtime keeps freed memory mapped on a CPU device
(``keep_freed_host_memory``) and, after every optimizer step, ``HeapGuard`` gives free pages
back (``malloc_trim``) when resident memory has grown half again over what it was once the
heap settled: the safety net for ranks started without the tunable, which it also warns
about once. ``HF_ELIXIR_KEEP_HOST_MEMORY=0`` leaves glibc's defaults alone (the guard still
runs). Other C libraries (musl, macOS, Windows) are left alone altogether.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

ENV = "HF_ELIXIR_KEEP_HOST_MEMORY"
TUNABLE_ENV = "GLIBC_TUNABLES"
#: what a CPU rank's environment needs before it starts (glibc reads it at start only)
TUNABLES = "glibc.malloc.tcache_count=0"

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_MAX = 2**31 - 1  # mallopt takes an int
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _load_glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_glibc()
_kept: Optional[bool] = None
_warned = False


def rank_tunables(current: str = "") -> str:
    """``GLIBC_TUNABLES`` for a CPU rank: ``current`` with ``TUNABLES`` added (a cache
    setting already there is left as it is)."""
    if "glibc.malloc.tcache_count=" in current:
        return current
    return f"{current}:{TUNABLES}" if current else TUNABLES


def rank_environment(env: Optional[dict] = None) -> dict:
    """``env`` (default: this process's) as a CPU rank should start with it."""
    env = dict(os.environ if env is None else env)
    env[TUNABLE_ENV] = rank_tunables(env.get(TUNABLE_ENV, ""))
    return env


@contextmanager
def spawning_cpu_ranks(enabled: bool = True) -> Iterator[None]:
    """Within: this process's environment carries ``TUNABLES``, so that the CPU ranks it
    starts (``multiprocessing`` spawn, subprocesses) start with it; restored after. Does
    nothing when not ``enabled`` (ranks that are not CPU ranks)."""
    if not enabled:
        yield
        return
    before = os.environ.get(TUNABLE_ENV)
    os.environ[TUNABLE_ENV] = rank_tunables(before or "")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TUNABLE_ENV, None)
        else:
            os.environ[TUNABLE_ENV] = before


def tcache_disabled() -> bool:
    """Whether this process was started with glibc's per-thread cache off."""
    return TUNABLES in os.environ.get(TUNABLE_ENV, "")


def keep_freed_host_memory() -> bool:
    """Make glibc keep freed memory mapped in this process (once); whether it does now.

    False when ``HF_ELIXIR_KEEP_HOST_MEMORY=0`` or the C library is not glibc."""
    global _kept
    if _kept is None:
        _kept = (
            _LIBC is not None
            and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")
            and bool(_LIBC.mallopt(_M_MMAP_MAX, 0))  # mallopt returns 1 on success
            and bool(_LIBC.mallopt(_M_TRIM_THRESHOLD, _TRIM_MAX))
        )
    return _kept


def warn_if_heap_fragments(world_size: int) -> None:
    """Once per process: a multi-rank CPU run started without ``TUNABLES`` fragments."""
    global _warned
    if _warned or _LIBC is None or world_size < 2 or tcache_disabled():
        return
    _warned = True
    warnings.warn(
        f"this CPU rank was started without {TUNABLE_ENV}={TUNABLES}: glibc's heap fragments "
        "step after step under gloo, and hf_elixir gives memory back every few steps (costing "
        "page faults). `hf-elixir launch` sets it; with torchrun or accelerate launch, export "
        f"{TUNABLE_ENV}={TUNABLES} first",
        stacklevel=3,
    )


def resident_bytes() -> Optional[int]:
    """This process's resident memory (Linux), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class HeapGuard:
    """Gives free heap pages back when resident memory grows past ``growth`` times what it
    was after ``settle_steps`` steps (the heap grows over the first two). After a trim that
    leaves it above the mark anyway (the run really needs more), the mark moves up."""

    growth: float = 1.5
    settle_steps: int = 3
    steps: int = field(default=0, init=False)
    baseline: Optional[int] = field(default=None, init=False)
    trims: int = field(default=0, init=False)

    def after_step(self) -> bool:
        """Call between optimizer steps; whether it trimmed."""
        self.steps += 1
        if _LIBC is None or self.steps < self.settle_steps:
            return False
        rss = resident_bytes()
        if rss is None:
            return False
        if self.baseline is None:
            self.baseline = rss
            return False
        if rss <= self.growth * self.baseline:
            return False
        _LIBC.malloc_trim(0)
        self.trims += 1
        after = resident_bytes() or rss
        if after > self.baseline:
            self.baseline = after
        return True
