"""Bytes on the wire: the counting convention, the counter, and the predicted bytes per step.

One convention serves the runtime's own counter (``Collectives.counter``), the planner's
prediction (``step_traffic``) and the benchmark's counter of raw ``torch.distributed``
calls (``benchmarks/comm_count.py``), so the three can be compared exactly.

Convention: the bytes one rank *receives* when the logical collective runs as a ring,
for a full buffer of B bytes over W ranks, rounded down per call:

==================  =====================================================================
all_gather          B (W-1)/W   (B: the gathered output)
reduce_scatter      B (W-1)/W   (B: the full input)
all_reduce          2 B (W-1)/W (a reduce-scatter then an all-gather)
broadcast           B on every rank but the source, 0 on the source
host_to_device      the bytes copied (chunk data only, see below)
device_to_host      the bytes copied
==================  =====================================================================

How the runtime's collectives map onto kinds: on gloo (``host_collectives``) a chunk gather
is W broadcasts of one shard each; a rank receives the W-1 shards it does not own, exactly
an all-gather's bytes, so it is counted as ``all_gather``. A gloo gradient reduction is an
all-reduce of the whole chunk gradient (faster on gloo than its reduce-scatter, see
``Collectives``) and is counted as what it moves: ``all_reduce``, twice a reduce-scatter.

Host<->device counts the chunk data the runtime's staging and offload copies move on a CUDA
device: offloaded parameter shards going up for a gather, reduced gradient shards going down
to a host optimizer, updated shards going up from the staging buffer. A CPU compute device
has no second memory: "offloaded" state is already in host memory and no staging copy is
made, so nothing is counted there. The few-byte round trips of control scalars (norms,
flags) and the copy of the input batch are not counted.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from hf_elixir.planner import fetches
from hf_elixir.planner.record import chunk_layout
from hf_elixir.profile.needs import trace_fetch_needs

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "host_to_device", "device_to_host")
COLLECTIVE_KINDS = KINDS[:4]
#: ring factor: how many times (W-1)/W of the buffer a rank receives
_RING = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}

#: ``HF_ELIXIR_COLLECTIVES=tensor`` makes gloo run the tensor collectives NCCL runs (slower
#: on gloo, see runtime.comm.Collectives) so CPU tests exercise the GPU code path.
COLLECTIVES_ENV = "HF_ELIXIR_COLLECTIVES"

#: bytes of the small all-reduces of an optimizer step
_NORM_BYTES = {"2": 8, "inf": 4}  # the local norm: float64 sum of powers; float32 max for inf
_FLAG_BYTES = 4                    # fp16 overflow flag (float32)


def host_collectives(device_type: str) -> bool:
    """Whether the runtime uses its gloo strategy (broadcast gathers, all-reduce reductions)
    for a compute device of this type: host tensors go over gloo unless the environment asks
    for the tensor collectives NCCL uses."""
    return device_type != "cuda" and os.environ.get(COLLECTIVES_ENV, "auto") != "tensor"


def wire_bytes(kind: str, nbytes: int, world_size: int, source: bool = False) -> int:
    """Bytes one rank receives for one collective of ``kind`` over a ``nbytes`` buffer (see
    the module docstring); ``source``: this rank is the broadcast's source."""
    if world_size <= 1:
        return 0
    if kind == "broadcast":
        return 0 if source else int(nbytes)
    return _RING[kind] * int(nbytes) * (world_size - 1) // world_size


@dataclass
class CommCounter:
    """Bytes and calls by kind since the last reset, plus what the bytes are per.

    Integer adds only: counting never synchronises a device or the ranks."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    steps: int = 0            # optimizer steps (an fp16 step skipped for overflow counts)
    forward_passes: int = 0
    backward_passes: int = 0

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def collective(self, kind: str, nbytes: int, world_size: int, source: bool = False) -> None:
        """Count one collective over a ``nbytes`` buffer by the convention."""
        self.add(kind, wire_bytes(kind, nbytes, world_size, source))

    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        for kind in KINDS:
            self.bytes[kind] = 0
            self.calls[kind] = 0
        self.steps = self.forward_passes = self.backward_passes = 0

    def report(self) -> dict:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls), "total_bytes": self.total(),
                "steps": self.steps, "forward_passes": self.forward_passes,
                "backward_passes": self.backward_passes}


# ---------------------------------------------------------------------- gathers per step
def gathers_per_chunk(pins: Sequence[tuple[str, str]], module_params: Mapping[str, Sequence[str]],
                      chunks: Sequence[Sequence[str]], rcache_blocks: int, prefetch_depth: int,
                      world_size: int, param_cpu: frozenset[int] = frozenset(),
                      frozen: frozenset[int] = frozenset()) -> list[int]:
    """Per chunk, the gathers one steady-state training step starts: the runtime's fetching
    replayed over the traced pin sequence (``Trace.pins``; ``hf_elixir.planner.fetches``),
    the gathers the step's optimizer step starts for the next one included. With a block
    for every chunk, each trainable chunk the pass uses is gathered exactly once, and a
    ``frozen`` one not at all (it stays gathered from one step to the next)."""
    chunk_of = {name: i for i, params in enumerate(chunks) for name in params}
    requests = fetches.fetch_ops(pins, module_params, chunk_of, len(chunks))
    return fetches.replay(requests, rcache_blocks, prefetch_depth, world_size, param_cpu, frozen).gathers


# ---------------------------------------------------------------------- predicted bytes
def step_traffic(chunk_numels: Sequence[int], itemsize: int, gathers: Sequence[int], world_size: int, *,
                 device_type: str, n_params: int, param_cpu: Sequence[bool], optim_cpu: Sequence[bool],
                 host: Optional[bool] = None, norm_type: Optional[float] = 2.0,
                 loss_scaling: bool = False, micro_batches: int = 1,
                 frozen: Optional[Sequence[bool]] = None) -> CommCounter:
    """The bytes one rank receives in one training step, by kind (the runtime's counter
    over the same step reads exactly this).

    Args:
        chunk_numels: each chunk's size in elements as the runtime lays it out
            (``chunk_layout``: contents plus alignment padding).
        itemsize: bytes per element of the compute dtype.
        gathers: per chunk, gathers per step (``gathers_per_chunk``).
        device_type: the compute device ("cuda" or "cpu"): only CUDA stages host copies.
        n_params: chunked parameters, frozen ones included (one flag byte each in the "which
            got a gradient" all-reduce of every step: the runtime keeps one per slot).
        param_cpu, optim_cpu: per chunk, whether its parameter shard / optimizer lives on the CPU.
        host: the gloo strategy (default: ``host_collectives(device_type)``).
        norm_type: gradient clipping's norm (None: the step does not clip).
        loss_scaling: fp16: one overflow-flag all-reduce per step.
        micro_batches: backward passes per optimizer step (each reduces every chunk once).
        frozen: per chunk, whether it is frozen: gathered (and uploaded when offloaded) like
            any chunk, never reduced, never staged for a host optimizer.

    Per backward pass every chunk's gradient is reduced once (a reduce-scatter; an all-reduce
    on gloo) and the ranks agree on late chunks (one all-reduce of a byte per chunk). Per
    step: the gathers; the all-reduce of one byte per parameter saying which got a
    gradient; the clipping norm and the fp16 flag. On CUDA, per gather of an offloaded
    parameter shard its upload; per backward of a host-optimizer chunk its reduced shard's
    download; per step the updated shard's upload when the shard lives on the device.
    (A late chunk is reduced a second time; that depends on the model's graph and is not
    predicted.)
    """
    W = world_size
    host = host_collectives(device_type) if host is None else host
    cuda = device_type == "cuda"
    out = CommCounter()
    for c, numel in enumerate(chunk_numels):
        full = numel * itemsize
        shard = full // W
        for _ in range(gathers[c]):
            if W > 1:
                out.collective("all_gather", full, W)
            if cuda and param_cpu[c]:
                out.add("host_to_device", shard)
        if frozen is not None and frozen[c]:
            continue
        for _ in range(micro_batches):
            if W > 1:
                staged = cuda and optim_cpu[c]  # reduced on the device with the tensor collective
                out.collective("all_reduce" if host and not staged else "reduce_scatter", full, W)
            if cuda and optim_cpu[c]:
                out.add("device_to_host", shard)
        if cuda and optim_cpu[c] and not param_cpu[c]:
            out.add("host_to_device", shard)
    if W > 1:
        for _ in range(micro_batches):
            # late-chunk flags and the ranks' health (uint8; runtime/reduce.py)
            out.collective("all_reduce", len(chunk_numels) + 1, W)
        out.collective("all_reduce", n_params + 1, W)  # which parameters got a gradient, any failure (uint8)
        if norm_type is not None:
            out.collective("all_reduce", _NORM_BYTES["inf" if math.isinf(norm_type) else "2"], W)
        if loss_scaling:
            out.collective("all_reduce", _FLAG_BYTES, W)
    out.steps = 1
    out.forward_passes = out.backward_passes = micro_batches
    return out


def plan_traffic(plan, param_numels: Mapping[str, int], gathers: Sequence[int], device_type: str, *,
                 host: Optional[bool] = None, norm_type: Optional[float] = 2.0,
                 micro_batches: int = 1) -> CommCounter:
    """``step_traffic`` for an ``ElixirPlan``: chunk sizes laid out as the runtime lays them
    out (``chunk_layout``), placements and dtype from the plan; ``param_numels`` gives each
    chunked parameter's element count, ``gathers`` the gathers per chunk per step."""
    itemsize = plan.dtype.itemsize
    numels = [chunk_layout([param_numels[n] for n in c.params], itemsize, plan.world_size)[0]
              for c in plan.chunks]
    return step_traffic(
        numels, itemsize, gathers, plan.world_size, device_type=device_type,
        n_params=sum(len(c.params) for c in plan.chunks),
        param_cpu=[c.param_placement == "cpu" for c in plan.chunks],
        # a disk chunk's gradient shard goes down and its update runs on the host, as a "cpu" one's
        optim_cpu=[c.optim_placement != "device" and not c.frozen for c in plan.chunks],
        host=host, norm_type=norm_type, loss_scaling=plan.compute_dtype == "float16",
        micro_batches=micro_batches, frozen=[c.frozen for c in plan.chunks],
    )


def traced_gathers(plan, model, example_batch) -> list[int]:
    """Gathers per chunk per step for ``plan`` on ``model``, from one traced step on the meta
    device (what ``ElixirPlan.simple`` traces), for plans that carry no search predictions."""
    needs = trace_fetch_needs(model, example_batch, plan.fetch_units, plan.activation_checkpointing)
    on_host = frozenset(i for i, c in enumerate(plan.chunks) if c.param_placement == "cpu")
    return gathers_per_chunk(needs.pins, needs.module_params, [c.params for c in plan.chunks],
                             plan.rcache_blocks, plan.prefetch_depth, plan.world_size, on_host,
                             frozenset(plan.frozen_chunks))


def predictions(counter: CommCounter, gathers: Sequence[int], host: bool) -> dict:
    """The plan.predictions entries for one step's traffic."""
    return {
        "comm_bytes_per_step": counter.total(),
        "comm_bytes_by_kind": dict(counter.bytes),
        "gathers_by_chunk": list(gathers),
        "collectives": "host (gloo broadcasts and all-reduces)" if host else "tensor (all-gather, reduce-scatter)",
    }
