"""The plan search: the fastest plan whose predicted peak memory fits the budget.

Enumerated, for each candidate chunk size (``packing.chunk_size_candidates``; parameters packed
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

import functools
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from hf_elixir.hardware import HardwareProfile, parse_memory
from hf_elixir.planner import activations, cost, disk, fetches, host_steps, levers, packing, pricing, traffic
from hf_elixir.planner.candidate import Candidate, chain, signature
from hf_elixir.planner.efficiency import check_efficiency, compute_figures, model_efficiency
from hf_elixir.planner.memo import CandidateMemo
from hf_elixir.planner.record import ChunkPlan, ElixirPlan, PlanError, canonical_dtype
from hf_elixir.planner.verdict import alternatives as _alternatives, infeasible as _infeasible
from hf_elixir.profile.forked import forked_map
from hf_elixir.profile.needs import rcache_minimum
from hf_elixir.profile.params import chunked_parameters, model_signature
from hf_elixir.profile.profiler import ModelProfile, model_checkpoints, profile_model
from hf_elixir.optimizers import DEFAULT as DEFAULT_OPTIMIZER, OPTIMIZERS
from hf_elixir.vocab import format_bytes

T = TypeVar("T")
PREFETCH_DEPTHS = (0, 1, 2)
MAX_GRID = 128
#: most counts of offloaded frozen chunks tried per (chunk size, checkpointing, rCache,
#: prefetch): each needs its own simulated step
FROZEN_GRID = 8


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


# ---------------------------------------------------------------------- enumeration
def _collector_paused(search: Callable[..., T]) -> Callable[..., T]:
    """Run ``search`` with Python's cyclic garbage collector paused (restored after).

    The search makes millions of small tuples and lists, none of them in reference cycles,
    so reference counting frees them all the same; but each burst of them sets off the
    collector, whose full passes walk every live object, the model's traces included: about
    a third of the search on a 70B trace."""
    @functools.wraps(search)
    def paused(*args: Any, **kwargs: Any) -> T:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return search(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return paused


#: the last searches' candidates (``memo``): plans of one profile at other budgets reuse them
CANDIDATES = CandidateMemo()


def enumerate_candidates(profile: ModelProfile, hw: HardwareProfile, world_size: int,
                         compute_dtype: str, optimizer: str,
                         efficiency: float | None = None, workers: int = 1) -> tuple[list[Candidate], dict]:
    """Every candidate with its predicted memory and time (independent of the budget, so
    recalled from ``CANDIDATES`` when this profile was searched so before: shared, never
    to be changed in place).

    ``efficiency``: this model's measured compute efficiency (``model_efficiency``); None
    takes the calibrated one for the model's width. ``workers``: processes to search the
    chunk sizes in (``profile.forked``; the command line's, never a training process's). Returns the candidates and, per chunk
    size, its packing (each chunk trainable or frozen: ``frozen_chunk_ids``).
    """
    return CANDIDATES.recall(profile, hw, (world_size, compute_dtype, optimizer, efficiency), lambda: _enumerate(
        profile, hw, world_size, compute_dtype, optimizer, efficiency, workers))


@_collector_paused
def _enumerate(profile: ModelProfile, hw: HardwareProfile, world_size: int, compute_dtype: str, optimizer: str,
               efficiency: float | None, workers: int) -> tuple[list[Candidate], dict]:
    sizes = {p.name: p.numel for p in profile.params}
    frozen_names = frozenset(p.name for p in profile.params if p.frozen)
    order = profile.param_order()
    cb = cost.DTYPE_BYTES[compute_dtype]
    ranks_per_node = min(world_size, hw.gpus_per_node)
    figs = compute_figures(profile, hw, world_size, efficiency)
    # each fetch event: its operators, plus what the runtime's hooks cost around them
    price = lambda w: pricing.price(w, figs, compute_dtype) + figs.event_overhead  # noqa: E731
    context = hw.context_bytes if hw.device_type == "cuda" else 0
    modes = [False] + ([True] if profile.checkpointed is not None else [])
    # each event's compute is the same whatever the packing: priced once
    priced = {ckpt: [price(w) for w in profile.step(ckpt).trace.work] for ckpt in modes}

    def one_packing(S: int) -> tuple[list[list[str]], list[Candidate]]:
        out: list[Candidate] = []
        chunks = packing.pack(order, sizes, S, frozen_names)
        n = len(chunks)
        frozen = frozen_chunk_ids(chunks, frozen_names)
        trainable = [i for i in range(n) if i not in frozen]
        fz = sorted(frozen)
        nt, nf = len(trainable), len(fz)
        param_chunk = {name: i for i, c in enumerate(chunks) for name in c}
        elems = packing.layout_sizes(chunks, sizes, world_size, cb)
        chunk_bytes = [e * cb for e in elems]
        adopted = packing.adopting_chunks(chunks, sizes, elems) - frozen
        links = cost.Links.of(hw, world_size, figs)
        for ckpt in modes:
            step = profile.step(ckpt)
            tr = step.trace
            seq = cost.access_sequence(tr.events, tr.module_params, priced[ckpt], param_chunk, None)
            requests = fetches.fetch_ops(tr.pins, tr.module_params, param_chunk, n, tr.events)
            span = cost.max_span(tr.module_params, param_chunk)
            nested = rcache_minimum(tr.pins, tr.module_params, chunks)
            live = tr.live or [(0, step.memory.peak)] * len(seq)
            setup = cost.sim_setup(seq, chunk_bytes, world_size, links, adopted, frozen)
            reach = host_steps.forward_reach(seq, n)
            ctx = _Context(S, n, ckpt, elems, cb, world_size, compute_dtype, optimizer,
                           profile.buffer_bytes, context, hw, figs, live, frozen, trainable, setup)
            replayed = _Replays(requests, world_size, frozen)

            def simulated(R: int, d: int, on_host: frozenset[int]):
                sim = cost.simulate(seq, replayed(R, d, on_host), chunk_bytes, world_size, links,
                                    param_cpu=on_host, adopted=adopted, frozen=frozen, setup=setup)
                sides = host_steps.host_sides(sim.rs_done, sim.backward_end, reach, elems, world_size, cb,
                                              hw, ranks_per_node, trainable)
                return sim, sides

            for d in PREFETCH_DEPTHS:
                r_min = max(2, span + max(1, d), nested)
                r_max = max(n, r_min)
                for R in _rcache_grid(r_min, r_max):
                    # frozen chunks' shards on the CPU (the tail first), each count with every
                    # count of offloaded optimizers; only with prefetch, which is what hides
                    # their uploads (without, the same memory is always faster with prefetch)
                    for f in _grid(0, nf, FROZEN_GRID) if d else [0]:
                        sim, sides = simulated(R, d, frozenset(fz[nf - f:]))
                        for k in _grid(0, nt):
                            out.append(_candidate(ctx, R, d, k, 0, f, sim, sides[k]))
                    if d == 1 and R == r_min and nt:
                        # trainable parameters offloaded too, after every optimizer and every
                        # frozen chunk (read-only, they go first)
                        for p in _grid(1, nt, 16):
                            on_host = frozenset(trainable[nt - p:]) | frozen
                            sim_p, sides_p = simulated(R, d, on_host)
                            out.append(_candidate(ctx, R, d, nt, p, nf, sim_p, sides_p[nt]))
        return chunks, out

    # each chunk size is searched on its own: with workers, in forked processes side by side
    tried = list(packing.chunk_size_candidates(sizes.values(), world_size))
    made = forked_map(one_packing, tried, workers)
    packings = {S: chunks for S, (chunks, _) in zip(tried, made)}
    found = [c for _, found in made for c in found]  # and with the long-context levers:
    return found + activations.of_profile(found, profile, priced, hw, figs, context), packings


def frozen_chunk_ids(chunks: list[list[str]], frozen_names: frozenset[str] | set[str]) -> frozenset[int]:
    """The chunks of a packing (``packing.pack``) that hold frozen parameters: a chunk holds one
    kind only, so its first parameter tells."""
    return frozenset(i for i, c in enumerate(chunks) if c and c[0] in frozen_names)


class _Replays:
    """The fetch replays of one request sequence (one packing, checkpointing on or off), each
    made once. The search asks for the same one many times: at world size 2 and more every
    placement of one (rCache, prefetch) shares a replay (shards are gathered whether they lie
    on the device or the CPU); at world size 1 a shard on the device is its own block, so
    only offloaded chunks take blocks, and every rCache at least as large as their number
    replays alike (no block is ever short: nothing is evicted)."""

    def __init__(self, requests: fetches.Requests, world_size: int, frozen: frozenset[int]) -> None:
        self.requests, self.world_size, self.frozen = requests, world_size, frozen
        self.made: dict[tuple, fetches.FetchReplay] = {}

    def __call__(self, blocks: int, prefetch: int, on_host: frozenset[int]) -> fetches.FetchReplay:
        if self.world_size == 1:
            key = (min(blocks, len(on_host)), prefetch, on_host)
        else:
            key = (blocks, prefetch, frozenset())  # the placement does not change the fetching
        if key not in self.made:
            self.made[key] = fetches.replay(self.requests, blocks, prefetch, self.world_size,
                                            on_host if self.world_size == 1 else frozenset(), self.frozen)
        return self.made[key]


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
    setup: cost.SimSetup  # the simulation's placement-independent part
    _peaks: dict = field(default_factory=dict, repr=False)

    def buffer_peak(self, buffered: list[int]) -> tuple[float, float, float]:
        """For full-chunk gradient buffers of the chunks ``buffered``: the most bytes of them
        alive at once (what the runtime's ledger sees), and activations and buffers at the
        instant their sum peaks (``cost.aligned_peak``). Neither depends on the fetching or the
        placements, so each set is worked out once."""
        key = tuple(buffered)
        if key not in self._peaks:
            chunk_bytes = [e * self.cb for e in self.elems]
            ledger = self.setup.buffers_of(buffered, chunk_bytes)
            beyond = self.setup.beyond_trace(ledger, buffered, chunk_bytes)
            self._peaks[key] = (max(ledger, default=0.0), *cost.aligned_peak(self.live, beyond))
        return self._peaks[key]


def _candidate(x: _Context, R: int, d: int, k: int, p: int, f: int, sim: cost.SimResult,
               host: host_steps.HostSide) -> Candidate:
    """Candidate ``k`` optimizer-offloaded, ``p`` parameter-offloaded trainable chunks and
    ``f`` offloaded frozen chunks (the tails of each kind) with one simulated step."""
    hw, n, cb, W = x.hw, x.n, x.cb, x.W
    places = packing.Placements.tails(n, x.frozen, k, p, f)
    nt = len(x.trainable)
    # one rank adds gradients straight into device gradient shards: only chunks whose
    # optimizer (and so gradient shard) is offloaded need a full-chunk buffer
    buffered = x.trainable if W > 1 else x.trainable[nt - k:]
    ledger_buffers, act, buf = x.buffer_peak(buffered)
    mem = cost.memory(x.elems, W, x.dtype, x.optimizer, R, places, act, x.whole, x.context, buf,
                      cost.allocator_margin(hw))
    # what the runtime's ledger holds at its own peak (no activations, no buffers): its
    # gradient buffers peak later in backward than the step's total does
    ledger_peak = int(mem.parameters + mem.frozen_shards + mem.master_weights + mem.optimizer_state
                      + mem.rcache + mem.gradients - buf + ledger_buffers)
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
        exposed_cpu = host.exposed(device_end)  # the next forward's wait for host updates
        step = device_end + exposed_cpu
        cpu_time = off / (hw.cpu_adam_throughput / max(1, min(W, hw.gpus_per_node)))
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
        gathers=sim.gathers, host_ready=host.ready if hw.device_type != "cpu" else step,
    )


# ---------------------------------------------------------------------- public entry point
def plan(
    model: nn.Module | Any,
    example_batch: dict[str, torch.Tensor] | tuple[int, int],
    hardware: HardwareProfile | str | None = None,
    world_size: int | None = None,
    dtype: str | torch.dtype = "bf16",
    optimizer: str = DEFAULT_OPTIMIZER,
    memory_budget: int | str | None = None,
    profile: ModelProfile | None = None,
    alternatives: int = 5,
    efficiency: float | str = "auto",
    nodes: int | None = None,
    host_memory: int | str | None = None,
    nvme: bool = False,
    workers: int = 1,
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
        optimizer: a name of the optimizer table (``optimizers.OPTIMIZERS``).
        memory_budget: bytes (or "24GiB") per device the plan may use; default the device memory.
        host_memory: bytes (or "64GiB") of host memory per machine offloaded state may use
            (a share ``HOST_USABLE`` of it); default the profile's ``cpu_memory``.
        nvme: plan with a disk tier: optimizer state that neither device nor host memory
            holds goes to disk (``planner/disk.py``), priced at the profile's disk figures and
            checked against its ``disk_free``. The run then needs an ``nvme_path``.
        profile: a ``ModelProfile`` to reuse (must match model, batch and dtype).
        efficiency: how the step's compute is priced against the per-operator figures.
            ``"auto"``: when ``hardware`` is a calibration of this machine, the model is
            timed here at its micro-batch with every local rank busy (a few seconds, up to
            about a minute for a large CPU model; ``hf_elixir.measure.model_efficiency``), else the
            calibrated efficiency for its width is used. ``"measure"`` always times it,
            ``"calibrated"`` never does, and a number is taken as the efficiency. The plan's
            ``predictions["compute_efficiency"]`` says which was used.
        workers: processes to profile and search in (``profile.forked``): forked copies of
            this one, so only for a process without threads of its own (the command line).

    Raises:
        PlanError: nothing fits; says the smallest per-device memory that would and the largest
        batch size that fits this budget.
    """
    t0 = time.perf_counter()
    compute_dtype = canonical_dtype(dtype)
    check_efficiency(efficiency)
    optimizer = optimizer.lower()
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"unsupported optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    hw = _resolve_hardware(hardware, world_size, nodes)
    W = int(world_size or hw.world_size)
    if W < 1:
        raise PlanError(f"world_size must be >= 1, got {W}")
    budget = parse_memory(memory_budget) if memory_budget is not None else hw.device_memory
    if host_memory is not None:
        hw = hw.with_cluster()  # a copy: the caller's profile is not changed
        hw.cpu_memory, hw.sources["cpu_memory"] = parse_memory(host_memory), "user"
    untrainable = PlanError(
        "the model has no floating-point parameters that require gradients, so there is nothing "
        "to train; unfreeze some (or add an adapter, e.g. peft.get_peft_model) before planning"
    )
    if isinstance(model, nn.Module) and not any(p.requires_grad for _, p in chunked_parameters(model)):
        raise untrainable
    # a model whose own checkpointing is on checkpoints whatever the plan says: price only that
    own_ckpt = isinstance(model, nn.Module) and model_checkpoints(model)
    if profile is None:
        profile = profile_model(model, example_batch, dtype=compute_dtype, attention_target=hw.device_type,
                                checkpointing=True if own_ckpt else None, workers=workers)
    t_prof = time.perf_counter() - t0
    if not profile.trainable:
        raise untrainable
    measured = model_efficiency(efficiency, model, profile, hw, W, compute_dtype)
    measured["used"] = compute_figures(profile, hw, W, measured["value"]).efficiency

    cands, packings = enumerate_candidates(profile, hw, W, compute_dtype, optimizer, measured["value"], workers)
    if own_ckpt and profile.checkpointed is not None:
        cands = [c for c in cands if c.checkpointing]
    all_cands = cands
    if hw.device_type == "cuda":  # offloaded state must fit in the node's host memory
        host = lambda c: _host_bytes(c, W, compute_dtype, optimizer) * min(W, hw.gpus_per_node)  # noqa: E731
        if nvme:  # the fewest trailing chunks on disk that host memory needs, or none
            cands = disk.place(cands, host, HOST_USABLE * hw.cpu_memory, W, optimizer, hw, budget)
        else:
            cands = [c for c in cands if host(c) <= HOST_USABLE * hw.cpu_memory]
        if not any(c.peak <= budget for c in cands):
            blocked = [c for c in all_cands if c.peak <= budget]
            if blocked:  # device memory would do; the host cannot hold what must be offloaded
                if nvme:  # even with every offloaded optimizer on disk
                    blocked = [disk.priced(c, c.n_optim_cpu, W, optimizer, hw) for c in blocked]
                need = min(host(c) for c in blocked)
                raise PlanError(
                    f"no plan fits: plans that fit {format_bytes(budget)} per device exist, but they "
                    f"offload state needing at least {format_bytes(need)} of CPU memory per node"
                    f"{' with every offloaded optimizer on disk' if nvme else ''}, more "
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
    # for a recovery from an out-of-memory error (replan.tighten): what the runtime could
    # move to in place, and the least memory any plan needs (named when nothing is left)
    frac = cost.allocator_margin(hw)
    result.predictions["recovery_options"] = levers.recovery_options(best, cands, frac, profile.batch_size)
    result.predictions.update(levers.smallest_peaks(cands, frac, profile.batch_size))
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
    places = packing.Placements.tails(n, frozen, c.n_optim_cpu, c.n_param_cpu, c.n_frozen_cpu)
    on_disk = packing.Placements.tails(n, frozen, c.n_optim_disk, 0, 0).optim_cpu
    plan_chunks = [
        ChunkPlan(params=list(ch),
                  optim_placement="disk" if i in on_disk else "cpu" if i in places.optim_cpu else "device",
                  param_placement="cpu" if i in places.param_cpu else "device",
                  numel=sum(sizes[name] for name in ch),
                  frozen=i in frozen)
        for i, ch in enumerate(chunks)
    ]
    named = [(p.name, torch.empty(p.shape, device="meta", requires_grad=not p.frozen)) for p in profile.params]
    tokens = profile.batch_size * profile.seq_len * W
    step = profile.step(c.checkpointing)
    cb = cost.DTYPE_BYTES[compute_dtype]
    frozen_shards = sum(packing.layout_sizes([chunks[i] for i in frozen], sizes, W, cb)) // W * cb
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
        # what the offloaded state takes in host memory, per rank (chunks counted full size)
        "host_bytes_per_rank": int(_host_bytes(c, W, compute_dtype, optimizer)),
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
        "frozen": {"params": profile.n_frozen_params, "packed_params": profile.n_packed_params,
                   "bytes": profile.frozen_bytes,
                   "shard_bytes_per_rank": frozen_shards, "chunks": len(frozen),
                   "offloaded_chunks": c.n_frozen_cpu},
        "margin": {"allocator_fraction": cost.allocator_margin(hw),
                   "context_bytes": hw.context_bytes if hw.device_type == "cuda" else 0},
        **(extra or {}),
        **({"disk": disk.predictions(c, W, optimizer, hw)} if c.n_optim_disk else {}),
        **activations.predictions(c),
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
        block_policies=activations.block_policies(c, profile.extra.get("block_path", "")),
        logit_piece_tokens=c.logit_piece_tokens, mlp_tiles=c.mlp_tiles,
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
                    optimizer: str = DEFAULT_OPTIMIZER) -> list[ElixirPlan]:
    """The chosen plan's runners-up (``chosen.alternatives``) as runnable plans.

    Each is re-evaluated by the same cost model, at the compute efficiency the search used,
    so its predictions are the ones the search compared; the budget is the chosen plan's.
    """
    hw = _resolve_hardware(hardware, chosen.world_size)
    W, dtype = chosen.world_size, chosen.compute_dtype
    efficiency = chosen.predictions.get("compute_efficiency", {}).get("value")
    cands, packings = enumerate_candidates(profile, hw, W, dtype, optimizer, efficiency)
    keyed = {signature(c): c for c in cands}
    out = []
    for alt in chosen.alternatives:
        sig = (alt["chunk_size"], alt["activation_checkpointing"], alt["rcache_blocks"],
               alt["prefetch_depth"], alt["optim_offload_chunks"], alt["param_offload_chunks"],
               alt.get("frozen_offload_chunks", 0), tuple(alt.get("block_policies", ())),
               alt.get("logit_piece_tokens", 0), alt.get("mlp_tiles", 1))
        c = keyed[sig]
        p = materialize(c, packings[c.chunk_size], profile, hw, W, dtype, optimizer,
                        chosen.predictions.get("budget_bytes", c.peak))
        p.predictions["reason"] = alt.get("reason", "")
        out.append(p)
    return out


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
    shard per offloaded trainable or frozen chunk, and the pinned memory offloaded
    activations wait in (``activations``)."""
    shard = c.chunk_size // W
    per = disk.host_bytes_per_element(optimizer)
    # disk chunks keep none of it here (their gradient shards are on disk too), and the
    # rings hold a few of them
    on_disk = disk.kept_off_host(c, W, optimizer)
    return (c.n_optim_cpu * shard * per - on_disk
            + (c.n_param_cpu + c.n_frozen_cpu) * shard * cost.DTYPE_BYTES[dtype] + c.pinned_bytes)
