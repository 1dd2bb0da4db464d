"""The plan search: the fastest plan whose predicted peak memory fits the budget.

Enumerated, for each candidate chunk size (``cost.chunk_size_candidates``; parameters packed
in forward first-use order, frozen ones into chunks of their own): activation checkpointing
on/off, rCache blocks (from the minimum usable, a module's chunk span plus the prefetch
room, up to every chunk), prefetch depth 0-2, the number of tail frozen chunks whose shards
live on the CPU, the number of tail trainable chunks whose optimizer runs on the CPU, and,
with every optimizer and every frozen chunk offloaded, the number of tail trainable chunks
whose parameters also live on the CPU. Frozen chunks are the first candidates for parameter
offload: read-only, they cost one upload per gather and nothing else.

Selection. Candidates are ranked by (predicted step time, bytes communicated, bytes over
PCIe, peak memory), where a plan that offloads anything is charged ``OFFLOAD_MARGIN`` (2%)
more time: offloading must win clearly to be chosen. Before the budget is applied they are reduced to a *chain*: walking from
the smallest predicted peak upward, a candidate is kept only if it is faster than every
smaller one kept so far and offloads no more than they do. The plan for a budget is the
last chain element that fits. Hence, by construction: a larger budget never predicts a
slower step; a smaller budget never offloads less; a larger budget never predicts a step slower by more than the
offload margin (a plan that offloads to win a little time
is not chosen over one that needs less memory and offloads nothing — the predicted overlap
of CPU work is the least certain part of the model); whatever fits at all, some plan is
returned (the smallest candidate heads the chain); with room for everything the fastest
candidate — no offload, every chunk cached — is chosen.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from hf_elixir import calibrate
from hf_elixir.hardware import HardwareProfile, format_bytes, parse_memory
from hf_elixir.plan import cost, fetches, traffic
from hf_elixir.plan.needs import rcache_minimum
from hf_elixir.plan.plan import (ChunkPlan, ElixirPlan, PlanError, canonical_dtype, chunked_parameters,
                                 model_signature)
from hf_elixir.profile.profiler import ModelProfile, model_checkpoints, profile_model

OPTIMIZERS = ("adamw", "adam", "sgd")
PREFETCH_DEPTHS = (0, 1, 2)
#: an offloading plan must be predicted this much faster to be chosen over one that does not
#: offload: its overlap with compute is the least certain part of the cost model
OFFLOAD_MARGIN = 0.02
MAX_GRID = 128
#: most counts of offloaded frozen chunks tried per (chunk size, checkpointing, rCache,
#: prefetch): each needs its own simulated step
FROZEN_GRID = 8


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
        offloads = self.n_optim_cpu or self.n_param_cpu or self.n_frozen_cpu
        margin = 1.0 + OFFLOAD_MARGIN if offloads else 1.0
        return (round(self.step_time * margin * 1e9), round(self.comm_bytes), round(self.pcie_bytes), self.peak)

    def describe(self) -> dict[str, Any]:
        return {
            "chunk_size": self.chunk_size, "n_chunks": self.n_chunks,
            "activation_checkpointing": self.checkpointing, "rcache_blocks": self.rcache_blocks,
            "prefetch_depth": self.prefetch_depth, "optim_offload_chunks": self.n_optim_cpu,
            "param_offload_chunks": self.n_param_cpu, "frozen_chunks": self.n_frozen,
            "frozen_offload_chunks": self.n_frozen_cpu, "peak_bytes": int(self.peak),
            "step_time_s": self.step_time, "memory": dict(self.memory), "time": dict(self.time),
            "gathers_per_step": self.gathers,
        }


def _grid(lo: int, hi: int, limit: int = MAX_GRID) -> list[int]:
    if hi - lo + 1 <= limit:
        return list(range(lo, hi + 1))
    step = (hi - lo) / (limit - 1)
    return sorted({lo + round(i * step) for i in range(limit)} | {hi})


def _rcache_grid(lo: int, hi: int) -> list[int]:
    if hi - lo + 1 <= 16:
        return list(range(lo, hi + 1))
    vals = {lo, lo + 1, lo + 2, hi, hi - 1}
    x = float(lo)
    while x < hi:
        vals.add(int(x))
        x *= 1.35
    return sorted(v for v in vals if lo <= v <= hi)


# ---------------------------------------------------------------------- compute figures
def compute_figures(profile: ModelProfile, hw: HardwareProfile, world_size: int,
                    efficiency: float | None = None) -> calibrate.ComputeFigures:
    """The figures one rank's compute is priced with: the calibrated ones, at ``efficiency``
    when this model's own was measured, else at the calibrated one for its width."""
    figs = hw.compute_figures(min(world_size, hw.gpus_per_node))
    if efficiency is not None:
        return replace(figs, efficiency=efficiency)
    return figs.for_width(profile.hidden_size)


def local_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_efficiency(mode: float | str, model: Any, profile: ModelProfile, hw: HardwareProfile,
                     world_size: int, compute_dtype: str) -> dict[str, Any]:
    """What the plan's compute is priced at, and where that figure comes from.

    ``mode``: a number (taken as it is), ``"calibrated"`` (the calibration's width curve),
    ``"measure"`` (time this model here), or ``"auto"``: measure when ``hw`` holds figures
    calibrated on a machine of this kind, since only then are the model's timings and the
    prices comparable. Returns ``{"value": float | None, "source": str, ...details}``.
    """
    from hf_elixir import model_efficiency as measuring

    if isinstance(mode, (int, float)) and not isinstance(mode, bool):
        if mode <= 0:
            raise PlanError(f"efficiency must be a positive number, got {mode}")
        return {"value": float(mode), "source": "given"}
    if mode not in ("auto", "measure", "calibrated"):
        raise PlanError(f"efficiency must be a number, 'auto', 'measure' or 'calibrated'; got {mode!r}")
    local = bool(hw.compute) and hw.device_type == local_device_type()
    # a model on the meta device (``hf_elixir.profile.lora``'s LoRA fine-tunes) has no values
    # to run: only its config could be timed, and it is not at hand
    on_meta = isinstance(model, nn.Module) and any(p.is_meta for p in model.parameters())
    if mode == "measure" and on_meta:
        raise PlanError("efficiency='measure' times the model, but this one is on the meta device (no "
                        "values to run): pass the real model or its config, or efficiency='calibrated'")
    if mode == "calibrated" or (mode == "auto" and (not local or on_meta)):
        return {"value": None, "source": "calibrated"}
    if not local:
        raise PlanError(
            f"efficiency='measure' times the model on this machine, but the hardware profile "
            f"{hw.name!r} is not a calibration of it (a {local_device_type()} machine): run "
            "`hf-elixir calibrate` and plan with HardwareProfile.detect(), or pass efficiency='calibrated'"
        )
    figs = hw.compute_figures(min(world_size, hw.gpus_per_node))
    priced = sum(calibrate.price(w, figs, compute_dtype, efficiency=1.0) for w in profile.plain.trace.work)
    device = torch.device("cuda", torch.cuda.current_device()) if hw.device_type == "cuda" else torch.device("cpu")
    found = measuring.measure(model, (profile.batch_size, profile.seq_len), figs, device, compute_dtype,
                              ranks_per_node=min(world_size, hw.gpus_per_node), priced_whole=priced,
                              device_memory=hw.device_memory)
    if found is None:
        return {"value": None, "source": "calibrated"}
    return {"value": found.efficiency, "source": "measured", **found.as_dict()}


# ---------------------------------------------------------------------- enumeration
def enumerate_candidates(profile: ModelProfile, hw: HardwareProfile, world_size: int,
                         compute_dtype: str, optimizer: str,
                         efficiency: float | None = None) -> tuple[list[Candidate], dict]:
    """Every candidate with its predicted memory and time (independent of the budget).

    ``efficiency``: this model's measured compute efficiency (``model_efficiency``); None
    takes the calibrated one for the model's width. Returns the candidates and, per chunk
    size, its packing (each chunk trainable or frozen: ``frozen_chunk_ids``).
    """
    sizes = {p.name: p.numel for p in profile.params}
    frozen_names = frozenset(p.name for p in profile.params if p.frozen)
    order = profile.param_order()
    cb = cost.DTYPE_BYTES[compute_dtype]
    ranks_per_node = min(world_size, hw.gpus_per_node)
    figs = compute_figures(profile, hw, world_size, efficiency)
    # each fetch event: its operators, plus what the runtime's hooks cost around them
    price = lambda w: calibrate.price(w, figs, compute_dtype) + figs.event_overhead  # noqa: E731
    context = hw.context_bytes if hw.device_type == "cuda" else 0
    modes = [False] + ([True] if profile.checkpointed is not None else [])
    packings: dict[int, list[list[str]]] = {}
    out: list[Candidate] = []
    for S in cost.chunk_size_candidates(sizes.values(), world_size):
        chunks = cost.pack(order, sizes, S, frozen_names)
        packings[S] = chunks
        n = len(chunks)
        frozen = frozen_chunk_ids(chunks, frozen_names)
        trainable = [i for i in range(n) if i not in frozen]
        fz = sorted(frozen)
        nt, nf = len(trainable), len(fz)
        param_chunk = {name: i for i, c in enumerate(chunks) for name in c}
        elems = cost.layout_sizes(chunks, sizes, world_size, cb)
        chunk_bytes = [e * cb for e in elems]
        adopted = cost.adopting_chunks(chunks, sizes, elems) - frozen
        links = cost.Links.of(hw, world_size, figs)
        for ckpt in modes:
            step = profile.step(ckpt)
            tr = step.trace
            seq = cost.access_sequence(tr.events, tr.module_params, tr.work, param_chunk, price)
            requests = fetches.fetch_ops(tr.pins, tr.module_params, param_chunk, n, tr.events)
            span = cost.max_span(tr.module_params, param_chunk)
            nested = rcache_minimum(tr.pins, tr.module_params, chunks)
            live = tr.live or [(0, step.memory.peak)] * len(seq)
            ctx = _Context(S, n, ckpt, elems, cb, world_size, compute_dtype, optimizer,
                           profile.buffer_bytes, context, hw, figs, live, frozen, trainable)

            def simulated(R: int, d: int, on_host: frozenset[int], replayed: fetches.FetchReplay):
                # host shards change the fetching only at world size 1 (in place otherwise)
                if world_size == 1 and on_host:
                    replayed = fetches.replay(requests, R, d, world_size, on_host, frozen)
                sim = cost.simulate(seq, replayed, chunk_bytes, world_size, links, param_cpu=on_host,
                                    adopted=adopted, frozen=frozen)
                ends = cost.cpu_pipeline(sim.rs_done, sim.backward_end, elems, world_size, cb, hw,
                                         ranks_per_node, trainable)
                return sim, ends

            for d in PREFETCH_DEPTHS:
                r_min = max(2, span + max(1, d), nested)
                r_max = max(n, r_min)
                for R in _rcache_grid(r_min, r_max):
                    replayed = fetches.replay(requests, R, d, world_size, frozenset(), frozen)
                    # frozen chunks' shards on the CPU (the tail first), each count with every
                    # count of offloaded optimizers; only with prefetch, which is what hides
                    # their uploads (without, the same memory is always faster with prefetch)
                    for f in _grid(0, nf, FROZEN_GRID) if d else [0]:
                        sim, cpu_end = simulated(R, d, frozenset(fz[nf - f:]), replayed)
                        for k in _grid(0, nt):
                            out.append(_candidate(ctx, R, d, k, 0, f, sim, cpu_end[k]))
                    if d == 1 and R == r_min and nt:
                        # trainable parameters offloaded too, after every optimizer and every
                        # frozen chunk (read-only, they go first)
                        for p in _grid(1, nt, 16):
                            on_host = frozenset(trainable[nt - p:]) | frozen
                            sim_p, cpu_end_p = simulated(R, d, on_host, replayed)
                            out.append(_candidate(ctx, R, d, nt, p, nf, sim_p, cpu_end_p[nt]))
    return out, packings


def frozen_chunk_ids(chunks: list[list[str]], frozen_names: frozenset[str] | set[str]) -> frozenset[int]:
    """The chunks of a packing (``cost.pack``) that hold frozen parameters: a chunk holds one
    kind only, so its first parameter tells."""
    return frozenset(i for i, c in enumerate(chunks) if c and c[0] in frozen_names)


@dataclass
class _Context:
    """What every candidate of one (chunk size, checkpointing) pair shares."""

    S: int
    n: int
    ckpt: bool
    elems: list[int]
    cb: int
    W: int
    dtype: str
    optimizer: str
    whole: float  # bytes every rank holds whole: buffers, non-floating parameters
    context: float
    hw: HardwareProfile
    figs: Any
    live: list
    frozen: frozenset[int]
    trainable: list[int]


def _candidate(x: _Context, R: int, d: int, k: int, p: int, f: int, sim: cost.SimResult,
               cpu_end: float) -> Candidate:
    """Candidate ``k`` optimizer-offloaded, ``p`` parameter-offloaded trainable chunks and
    ``f`` offloaded frozen chunks (the tails of each kind) with one simulated step."""
    hw, n, cb, W = x.hw, x.n, x.cb, x.W
    places = cost.Placements.tails(n, x.frozen, k, p, f)
    nt = len(x.trainable)
    # one rank adds gradients straight into device gradient shards: only chunks whose
    # optimizer (and so gradient shard) is offloaded need a full-chunk buffer
    chunk_bytes = [e * cb for e in x.elems]
    buffered = x.trainable if W > 1 else x.trainable[nt - k:]
    ledger_buffers = sim.buffers_of(buffered, chunk_bytes)
    act, buf = cost.aligned_peak(x.live, sim.beyond_trace(ledger_buffers, buffered, chunk_bytes))
    mem = cost.memory(x.elems, W, x.dtype, x.optimizer, R, places, act, x.whole, x.context, buf,
                      cost.allocator_margin(hw))
    # what the runtime's ledger holds at its own peak (no activations, no buffers): its
    # gradient buffers peak later in backward than the step's total does
    ledger_peak = int(mem.parameters + mem.frozen_shards + mem.master_weights + mem.optimizer_state
                      + mem.rcache + mem.gradients - buf + max(ledger_buffers, default=0.0))
    shards = [e / W for e in x.elems]
    off = sum(shards[i] for i in x.trainable[nt - k:])
    off_params = sum(shards[i] for i in x.trainable[nt - p:])
    trained = sum(shards[i] for i in x.trainable)
    if hw.device_type == "cpu":  # optimizer and clipping share the rank's cores; nothing is copied
        dev_opt = cost.after_backward(trained, x.figs, hw, W)
        step = sim.backward_end + dev_opt
        cpu_time = off / x.figs.adam_rate
        exposed_cpu = 0.0
    else:
        dev_opt = (trained - off) / hw.device_adam_throughput
        device_end = sim.backward_end + dev_opt
        step = max(device_end, cpu_end)
        cpu_time = off / (hw.cpu_adam_throughput / max(1, min(W, hw.gpus_per_node)))
        exposed_cpu = max(0.0, cpu_end - device_end)
    # offloaded chunks: gradient shard down, updated parameters up (skipped when they stay on
    # CPU), offloaded shards (frozen ones too) up for each gather; a CPU device has no second
    # memory to copy to (as traffic.step_traffic counts)
    pcie = off * cb + (off - off_params) * cb + sim.h2d_param_bytes if hw.device_type != "cpu" else 0.0
    reduced = sum(x.elems[i] for i in x.trainable)
    return Candidate(
        chunk_size=x.S, n_chunks=n, checkpointing=x.ckpt, rcache_blocks=R, prefetch_depth=d,
        n_optim_cpu=k, n_param_cpu=p, peak=mem.total(), step_time=step,
        comm_bytes=sim.gather_bytes + reduced * cb * (W - 1) / W, pcie_bytes=pcie,
        memory=mem.as_dict(),
        ledger_peak=ledger_peak,
        n_frozen=len(x.frozen), n_frozen_cpu=f,
        time={
            "forward_backward": sim.backward_end,
            "compute": sim.compute,
            "collectives": sim.comm_busy,
            "exposed_communication": max(0.0, sim.backward_end - sim.compute),
            "device_optimizer": dev_opt,
            "cpu_optimizer": cpu_time,
            "pcie": pcie / hw.h2d_bandwidth,
            "exposed_cpu": exposed_cpu,
            "step": step,
        },
        gathers=sim.gathers,
    )


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


# ---------------------------------------------------------------------- public entry point
def plan(
    model: nn.Module | Any,
    example_batch: dict[str, torch.Tensor] | tuple[int, int],
    hardware: HardwareProfile | str | None = None,
    world_size: int | None = None,
    dtype: str | torch.dtype = "bf16",
    optimizer: str = "adamw",
    memory_budget: int | str | None = None,
    profile: ModelProfile | None = None,
    alternatives: int = 5,
    efficiency: float | str = "auto",
    nodes: int | None = None,
) -> ElixirPlan:
    """Profile ``model`` on the meta device and return the fastest plan that fits.

    Parameters with ``requires_grad=False`` (a PEFT model's base, frozen embeddings or
    layers) are planned as frozen chunks: sharded like the rest, held in the compute dtype
    only, offloaded to CPU memory first when the budget needs it.

    Args:
        model: an ``nn.Module`` (not modified; a PEFT model too) or a transformers config.
        example_batch: per-rank micro-batch: a dict of tensors (shapes only) or
            ``(batch_size, seq_len)``.
        hardware: a ``HardwareProfile``, a preset name, or None for ``HardwareProfile.detect()``.
        world_size: ranks to shard over (default: the hardware's GPUs per node x nodes).
        nodes: machines the ranks are spread over, evenly (default: the hardware profile's
            shape, or one machine when ``world_size`` fits on it). Collectives that span
            machines are priced at the profile's ``inter_node_bandwidth``.
        dtype: compute dtype ("bf16", "fp16", "fp32").
        optimizer: "adamw", "adam" or "sgd" (with momentum).
        memory_budget: bytes (or "24GiB") per device the plan may use; default the device memory.
        profile: a ``ModelProfile`` to reuse (must match model, batch and dtype).
        efficiency: how the step's compute is priced against the per-operator figures.
            ``"auto"``: when ``hardware`` is a calibration of this machine, the model is
            timed here at its micro-batch with every local rank busy (a few seconds, up to
            about a minute for a large CPU model; ``hf_elixir.model_efficiency``), else the
            calibrated efficiency for its width is used. ``"measure"`` always times it,
            ``"calibrated"`` never does, and a number is taken as the efficiency. The plan's
            ``predictions["compute_efficiency"]`` says which was used.

    Raises:
        PlanError: nothing fits; says the smallest per-device memory that would and the largest
        batch size that fits this budget.
    """
    t0 = time.perf_counter()
    compute_dtype = canonical_dtype(dtype)
    optimizer = optimizer.lower()
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"unsupported optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    hw = _resolve_hardware(hardware, world_size, nodes)
    W = int(world_size or hw.world_size)
    if W < 1:
        raise PlanError(f"world_size must be >= 1, got {W}")
    budget = parse_memory(memory_budget) if memory_budget is not None else hw.device_memory
    untrainable = PlanError(
        "the model has no floating-point parameters that require gradients, so there is nothing "
        "to train; unfreeze some (or add an adapter, e.g. peft.get_peft_model) before planning"
    )
    if isinstance(model, nn.Module) and not any(p.requires_grad for _, p in chunked_parameters(model)):
        raise untrainable
    # a model whose own checkpointing is on checkpoints whatever the plan says: price only that
    own_ckpt = isinstance(model, nn.Module) and model_checkpoints(model)
    if profile is None:
        profile = profile_model(model, example_batch, dtype=compute_dtype,
                                attention_target=hw.device_type, checkpointing=True if own_ckpt else None)
    t_prof = time.perf_counter() - t0
    if not profile.trainable:
        raise untrainable
    measured = model_efficiency(efficiency, model, profile, hw, W, compute_dtype)
    measured["used"] = compute_figures(profile, hw, W, measured["value"]).efficiency

    cands, packings = enumerate_candidates(profile, hw, W, compute_dtype, optimizer, measured["value"])
    if own_ckpt and profile.checkpointed is not None:
        cands = [c for c in cands if c.checkpointing]
    all_cands = cands
    if hw.device_type == "cuda":  # offloaded state must fit in the node's host memory
        host = lambda c: _host_bytes(c, W, compute_dtype, optimizer) * min(W, hw.gpus_per_node)  # noqa: E731
        cands = [c for c in cands if host(c) <= HOST_USABLE * hw.cpu_memory]
        if not any(c.peak <= budget for c in cands):
            blocked = [c for c in all_cands if c.peak <= budget]
            if blocked:  # device memory would do; the host cannot hold what must be offloaded
                need = min(host(c) for c in blocked)
                raise PlanError(
                    f"no plan fits: plans that fit {format_bytes(budget)} per device exist, but they "
                    f"offload state needing at least {format_bytes(need)} of CPU memory per node, more "
                    f"than the {format_bytes(HOST_USABLE * hw.cpu_memory)} usable of "
                    f"{format_bytes(hw.cpu_memory)} on {hw.name}. Use a machine with more CPU memory, "
                    "more GPUs (each holds a smaller shard) or GPUs with more memory."
                )
            cands = cands or all_cands  # nothing fits either way: explain by device memory
    path = chain(cands)
    fitting = [c for c in path if c.peak <= budget]
    if not fitting:
        raise _infeasible(profile, model, example_batch, cands, budget, hw, W, compute_dtype, optimizer)
    best = fitting[-1]
    timing = {"candidates": len(cands), "profile_seconds": t_prof, "model_checkpointing": own_ckpt,
              "search_seconds": time.perf_counter() - t0 - t_prof - measured.get("seconds", 0.0),
              "compute_efficiency": measured}
    result = materialize(best, packings[best.chunk_size], profile, hw, W, compute_dtype, optimizer,
                         budget, extra=timing)
    result.alternatives = _alternatives(best, cands, path, budget, alternatives)
    return result


def materialize(c: Candidate, chunks: list[list[str]], profile: ModelProfile, hw: HardwareProfile,
                world_size: int, compute_dtype: str, optimizer: str, budget: float,
                extra: dict[str, Any] | None = None) -> ElixirPlan:
    """The ``ElixirPlan`` of one candidate, with its predictions.

    The search calls it for the plan it chooses; ``candidate_plans`` for runners-up, so a
    benchmark can run every candidate it compares with the same code path.
    """
    W = world_size
    sizes = {p.name: p.numel for p in profile.params}
    n = len(chunks)
    frozen = frozen_chunk_ids(chunks, {p.name for p in profile.params if p.frozen})
    places = cost.Placements.tails(n, frozen, c.n_optim_cpu, c.n_param_cpu, c.n_frozen_cpu)
    plan_chunks = [
        ChunkPlan(params=list(ch),
                  optim_placement="cpu" if i in places.optim_cpu else "device",
                  param_placement="cpu" if i in places.param_cpu else "device",
                  numel=sum(sizes[name] for name in ch),
                  frozen=i in frozen)
        for i, ch in enumerate(chunks)
    ]
    named = [(p.name, torch.empty(p.shape, device="meta", requires_grad=not p.frozen)) for p in profile.params]
    tokens = profile.batch_size * profile.seq_len * W
    step = profile.step(c.checkpointing)
    cb = cost.DTYPE_BYTES[compute_dtype]
    frozen_shards = sum(cost.layout_sizes([chunks[i] for i in frozen], sizes, W, cb)) // W * cb
    predictions = {
        "peak_bytes": int(c.peak),
        "budget_bytes": int(budget),
        "memory": dict(c.memory),
        "ledger_peak_bytes": c.ledger_peak,
        "step_time_s": c.step_time,
        "time": dict(c.time),
        "tokens_per_s": tokens / c.step_time if c.step_time > 0 else None,
        "gathers_per_step": c.gathers,
        "comm_bytes_per_step": int(c.comm_bytes),
        "pcie_bytes_per_step": int(c.pcie_bytes),
        "activation_peak_bytes": {"plain": profile.plain.memory.peak,
                                  "checkpointed": profile.checkpointed.memory.peak if profile.checkpointed else None},
        "step_flops": step.memory.flops,
        "hardware": hw.name,
        "device_type": hw.device_type,
        # the cluster shape priced: collectives spanning machines run at the link between them
        "nodes": hw.nodes if W > hw.gpus_per_node else 1,
        "ranks_per_node": min(W, hw.gpus_per_node),
        "inter_node_bandwidth": hw.inter_node_bandwidth,
        "optimizer": optimizer,
        "batch_size": profile.batch_size,
        "seq_len": profile.seq_len,
        "model": profile.model_name,
        "n_params": profile.n_params,
        # the frozen weights: whole (what each rank would hold replicated) and as shards
        "frozen": {"params": profile.n_frozen_params, "bytes": profile.frozen_bytes,
                   "shard_bytes_per_rank": frozen_shards, "chunks": len(frozen),
                   "offloaded_chunks": c.n_frozen_cpu},
        "margin": {"allocator_fraction": cost.allocator_margin(hw),
                   "context_bytes": hw.context_bytes if hw.device_type == "cuda" else 0},
        **(extra or {}),
    }
    result = ElixirPlan(
        world_size=W,
        chunk_size=c.chunk_size,
        chunks=plan_chunks,
        compute_dtype=compute_dtype,
        rcache_blocks=c.rcache_blocks,
        activation_checkpointing=c.checkpointing,
        prefetch_depth=c.prefetch_depth,
        fetch_units=list(profile.fetch_units),
        borrowed={m: list(ps) for m, ps in profile.borrowed.items()},
        min_rcache_blocks=rcache_minimum(step.trace.pins, step.trace.module_params, chunks),
        signature=model_signature(named),
        predictions=predictions,
    )
    # bytes on the wire, as the runtime counts them (see traffic.py)
    host = traffic.host_collectives(hw.device_type)
    gathers = traffic.gathers_per_chunk(step.trace.pins, step.trace.module_params, chunks, c.rcache_blocks,
                                        c.prefetch_depth, W, places.param_cpu, frozen)
    wire = traffic.plan_traffic(result, sizes, gathers, hw.device_type, host=host)
    result.predictions.update(traffic.predictions(wire, gathers, host))
    return result


def candidate_plans(chosen: ElixirPlan, profile: ModelProfile, hardware: HardwareProfile | str,
                    optimizer: str = "adamw") -> list[ElixirPlan]:
    """The chosen plan's runners-up (``chosen.alternatives``) as runnable plans.

    Each is re-evaluated by the same cost model, at the compute efficiency the search used,
    so its predictions are the ones the search compared; the budget is the chosen plan's.
    """
    hw = _resolve_hardware(hardware, chosen.world_size)
    W, dtype = chosen.world_size, chosen.compute_dtype
    efficiency = chosen.predictions.get("compute_efficiency", {}).get("value")
    cands, packings = enumerate_candidates(profile, hw, W, dtype, optimizer, efficiency)
    keyed = {_signature(c): c for c in cands}
    out = []
    for alt in chosen.alternatives:
        sig = (alt["chunk_size"], alt["activation_checkpointing"], alt["rcache_blocks"],
               alt["prefetch_depth"], alt["optim_offload_chunks"], alt["param_offload_chunks"],
               alt.get("frozen_offload_chunks", 0))
        c = keyed[sig]
        p = materialize(c, packings[c.chunk_size], profile, hw, W, dtype, optimizer,
                        chosen.predictions.get("budget_bytes", c.peak))
        p.predictions["reason"] = alt.get("reason", "")
        out.append(p)
    return out


def _signature(c: Candidate) -> tuple:
    return (c.chunk_size, c.checkpointing, c.rcache_blocks, c.prefetch_depth, c.n_optim_cpu, c.n_param_cpu,
            c.n_frozen_cpu)


def _resolve_hardware(hardware, world_size, nodes: int | None = None) -> HardwareProfile:
    if hardware is None:
        hw = HardwareProfile.detect()
    elif isinstance(hardware, str):
        hw = HardwareProfile.preset(hardware)
    else:
        hw = hardware
    if nodes is not None:
        W = int(world_size or hw.world_size)
        if nodes < 1 or W % nodes:
            raise PlanError(f"{W} ranks cannot be spread evenly over {nodes} machine(s); give every "
                            "machine the same number of processes")
        return hw.with_cluster(gpus_per_node=W // nodes, nodes=nodes)
    if world_size is not None and world_size != hw.world_size:
        if hw.gpus_per_node > 1 and world_size % hw.gpus_per_node == 0:
            hw = hw.with_cluster(nodes=world_size // hw.gpus_per_node)
        else:
            hw = hw.with_cluster(gpus_per_node=world_size, nodes=1)
    return hw


HOST_USABLE = 0.9  # share of the node's CPU memory offloaded state may take (the rest: OS, data)


def _host_bytes(c: Candidate, W: int, dtype: str, optimizer: str) -> float:
    """Host bytes one rank's offloaded state takes at most (every chunk counted full size):
    master, optimizer state and gradient shard per offloaded optimizer, the compute-dtype
    shard per offloaded trainable or frozen chunk."""
    shard = c.chunk_size // W
    per = 4 + cost.OPTIMIZER_STATE_BYTES[optimizer] + 4
    return (c.n_optim_cpu * shard * per
            + (c.n_param_cpu + c.n_frozen_cpu) * shard * cost.DTYPE_BYTES[dtype])


def _config_label(c: Candidate) -> str:
    frozen = f", frozen offload {c.n_frozen_cpu}/{c.n_frozen}" if c.n_frozen else ""
    return (f"chunk {c.chunk_size / 1e6:.2f}M x{c.n_chunks}, rCache {c.rcache_blocks}, "
            f"ckpt {'on' if c.checkpointing else 'off'}, prefetch {c.prefetch_depth}, "
            f"optim offload {c.n_optim_cpu}/{c.n_trainable}, param offload {c.n_param_cpu}/{c.n_trainable}"
            f"{frozen}")


def _alternatives(best: Candidate, cands: list[Candidate], path: list[Candidate], budget: float,
                  limit: int) -> list[dict[str, Any]]:
    """The best few losers, one per distinct reason, each with why it lost."""
    out: list[dict[str, Any]] = []
    seen: set[tuple] = {_signature(best)}

    def add(c: Candidate, reason: str) -> None:
        sig = _signature(c)
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


def _infeasible(profile: ModelProfile, model, example_batch, cands: list[Candidate], budget: float,
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
        f"(smallest plan: {_config_label(smallest)}), but the budget is {format_bytes(budget)}. "
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
