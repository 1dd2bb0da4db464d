"""Byte accounting of what the runtime holds on the compute device, by category.

Tests and the planner compare these figures with the plan's predictions, so they count
exactly the tensors the runtime allocates (not allocator caches or RSS, which hide
sharding savings behind reuse). Where a category and the planner's memory model
(``planner/memory_model.py``) share a name, they mean the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = (
    "param_shards",      # compute-dtype shards of trainable parameters placed on the device
    "frozen_shards",     # compute-dtype shards of frozen parameters placed on the device
    "rcache",            # gathered chunks (at most rcache_blocks of them)
    "grad_buffers",      # full-chunk gradients waiting to be reduce-scattered
    "grad_shards",       # fp32 gradient shards on the device
    "master_weights",    # fp32 master shards on the device (none where the master is the shard)
    "optimizer_state",   # optimizer moments on the device
    "temporary",         # short-lived gathers for state_dict and similar
    # saved activations of blocks whose policy offloads them, while on the device (the
    # block running and the one whose copy is in flight: runtime/activation_offload.py)
    "offloaded_activations",
)


@dataclass
class MemoryLedger:
    current: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    peak_total: int = 0

    def add(self, category: str, nbytes: int) -> None:
        self.current[category] += nbytes
        if self.current[category] > self.peak[category]:
            self.peak[category] = self.current[category]
        total = sum(self.current.values())
        if total > self.peak_total:
            self.peak_total = total

    def sub(self, category: str, nbytes: int) -> None:
        self.current[category] -= nbytes
        assert self.current[category] >= 0, f"ledger underflow in {category}"

    def reset_peak(self) -> None:
        self.peak = dict(self.current)
        self.peak_total = sum(self.current.values())

    def report(self) -> dict:
        return {
            "current": dict(self.current),
            "peak": dict(self.peak),
            "current_total": sum(self.current.values()),
            "peak_total": self.peak_total,
        }
