"""A candidate plan as the search sees it: the decisions, what the cost model predicts for
them, and the order the search ranks candidates in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

#: an offloading plan must be predicted this much faster to be chosen over one that does not
#: offload: its overlap with compute is the least certain part of the cost model
OFFLOAD_MARGIN = 0.02

@dataclass
class Candidate:
    chunk_size: int
    n_chunks: int
    checkpointing: bool
    rcache_blocks: int
    prefetch_depth: int
    n_optim_cpu: int
    n_param_cpu: int
    peak: float
    step_time: float
    comm_bytes: float
    pcie_bytes: float
    memory: dict[str, int]
    time: dict[str, float]
    gathers: int
    ledger_peak: int = 0  # what the runtime's ledger holds at its own peak
    n_frozen: int = 0       # chunks that hold frozen parameters (among n_chunks)
    n_frozen_cpu: int = 0   # the last of them whose shards live on the CPU
    n_optim_disk: int = 0   # the last of the optimizer-offloaded chunks whose state is on disk
    #: the latest start of the next forward that no host update would make wait
    #: (``host_steps.HostSide.ready``; planner/disk.py delays it by exposed disk I/O)
    host_ready: float = 0.0
    #: the long-context levers (``planner/activations.py``): a policy per block (empty: every
    #: block follows ``checkpointing``), the logit piece in tokens (0: whole), the MLP's
    #: sequence tiles, and the pinned host bytes offloaded activations take
    policies: tuple[str, ...] = ()
    logit_piece_tokens: int = 0
    mlp_tiles: int = 1
    pinned_bytes: float = 0.0

    @property
    def n_trainable(self) -> int:
        return self.n_chunks - self.n_frozen

    @property
    def optim_offload(self) -> float:
        """Share of the trainable chunks whose optimizer runs on the CPU."""
        return self.n_optim_cpu / max(1, self.n_trainable)

    @property
    def param_offload(self) -> float:
        """Share of the trainable chunks whose parameter shards live on the CPU."""
        return self.n_param_cpu / max(1, self.n_trainable)

    @property
    def frozen_offload(self) -> float:
        """Share of the frozen chunks whose shards live on the CPU."""
        return self.n_frozen_cpu / max(1, self.n_frozen)

    def key(self) -> tuple:
        """What the search ranks by: predicted time, offloading plans charged
        ``OFFLOAD_MARGIN`` extra (see the module docstring), then bytes moved, then memory."""
        offloads = self.n_optim_cpu or self.n_param_cpu or self.n_frozen_cpu or self.pinned_bytes
        margin = 1.0 + OFFLOAD_MARGIN if offloads else 1.0
        return (round(self.step_time * margin * 1e9), round(self.comm_bytes), round(self.pcie_bytes), self.peak)

    def describe(self) -> dict[str, Any]:
        return {
            "chunk_size": self.chunk_size, "n_chunks": self.n_chunks,
            "activation_checkpointing": self.checkpointing, "rcache_blocks": self.rcache_blocks,
            "prefetch_depth": self.prefetch_depth, "optim_offload_chunks": self.n_optim_cpu,
            "optim_disk_chunks": self.n_optim_disk,
            "param_offload_chunks": self.n_param_cpu, "frozen_chunks": self.n_frozen,
            "frozen_offload_chunks": self.n_frozen_cpu, "peak_bytes": int(self.peak),
            "step_time_s": self.step_time, "memory": dict(self.memory), "time": dict(self.time),
            "gathers_per_step": self.gathers,
            "block_policies": list(self.policies), "logit_piece_tokens": self.logit_piece_tokens,
            "mlp_tiles": self.mlp_tiles, "pinned_activation_bytes": int(self.pinned_bytes),
        }


def chain(cands: list[Candidate]) -> list[Candidate]:
    """The budget-independent selection chain (see the module docstring)."""
    # among equals, the largest rCache (at world size 1 it costs nothing: shards are blocks)
    ordered = sorted(cands, key=lambda c: (c.peak, c.key(), -c.rcache_blocks))
    kept: list[Candidate] = []
    for c in ordered:
        if not kept:
            kept.append(c)
            continue
        last = kept[-1]
        if (c.key() < last.key() and c.optim_offload <= last.optim_offload
                and c.param_offload <= last.param_offload and c.frozen_offload <= last.frozen_offload):
            kept.append(c)
    return kept


def signature(c: Candidate) -> tuple:
    return (c.chunk_size, c.checkpointing, c.rcache_blocks, c.prefetch_depth, c.n_optim_cpu, c.n_param_cpu,
            c.n_frozen_cpu, tuple(c.policies), c.logit_piece_tokens, c.mlp_tiles)


def config_label(c: Candidate) -> str:
    frozen = f", frozen offload {c.n_frozen_cpu}/{c.n_frozen}" if c.n_frozen else ""
    return (f"chunk {c.chunk_size / 1e6:.2f}M x{c.n_chunks}, rCache {c.rcache_blocks}, "
            f"ckpt {'on' if c.checkpointing else 'off'}, prefetch {c.prefetch_depth}, "
            f"optim offload {c.n_optim_cpu}/{c.n_trainable}, param offload {c.n_param_cpu}/{c.n_trainable}"
            f"{frozen}{_long_context_label(c)}")


def _long_context_label(c: Candidate) -> str:
    if not (c.policies or c.logit_piece_tokens or c.mlp_tiles > 1):
        return ""
    parts = [f"blocks {describe_runs(c.policies)}"] if c.policies else []
    if c.logit_piece_tokens:
        parts.append(f"logits in pieces of {c.logit_piece_tokens}")
    if c.mlp_tiles > 1:
        parts.append(f"MLP in {c.mlp_tiles} tiles")
    return ", " + ", ".join(parts)


def runs(policies: Sequence[str]) -> list[tuple[int, int, str]]:
    """``(first, last, policy)`` for each run of consecutive blocks with one policy."""
    out: list[tuple[int, int, str]] = []
    for i, p in enumerate(policies):
        if out and out[-1][2] == p:
            out[-1] = (out[-1][0], i, p)
        else:
            out.append((i, i, p))
    return out


def describe_runs(policies: Sequence[str]) -> str:
    """``0-27 recompute_offload, 28-31 recompute``: the policies, compactly."""
    return ", ".join(f"{a}-{b} {p}" if a != b else f"{a} {p}" for a, b, p in runs(policies))
