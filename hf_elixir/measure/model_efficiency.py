"""How fast *this* model computes at its planned micro-batch, measured on this machine.

The calibration (``hf_elixir.measure.calibrate``) prices a step operator by operator and corrects the
sum by an ``efficiency`` measured on a small stand-in causal LM at a few widths. A real model
differs from the stand-in in ways the per-operator prices miss: a vocabulary of 867 instead
of 8192 leaves a tiny model's step dominated by per-operator costs, and a Hugging Face
block's extra reshapes, masks and casts cost 4-9% on top of the stand-in's at the same width
(issue 9). So before a local plan is searched, the model itself is timed: its forward and
backward at the planned micro-batch, on the planned device, with every rank of the node busy
as in training, against the same model's price from its meta trace. The ratio replaces the
calibrated width curve for this plan.

The copies timed take turns step by step, so that a drift of the machine's speed falls on
each alike. A model whose step is priced at most ``WHOLE_STEP_SECONDS`` is timed whole. A
larger one is timed with one and with ``k`` of its transformer blocks (the longest
``nn.ModuleList`` of same-class modules; ``k`` as many as a step of ``WHOLE_STEP_SECONDS``
allows, two at least) and the whole step is extrapolated:
``efficiency = (m1 + (L-1)/(k-1) (mk-m1)) / (p1 + (L-1)/(k-1) (pk-p1))`` for measured ``m``
and priced ``p`` over ``L`` blocks.

The extrapolation multiplies the noise of ``mk - m1`` by ``(L-1)/(k-1)``, which is why the
budget is a few seconds, not less: from one and two blocks the estimate scatters widely,
from one and most blocks it agrees with timing the whole model (docs/planning.md has the
figures).

Where the ranks run:
- inside a distributed job (``torch.distributed`` initialised: ``accelerate launch``), every
  rank times its own copy at once, and the times are averaged with an all-reduce, so every
  rank plans with the same figure;
- in one process planning for several CPU ranks (``hf-elixir plan``, the benchmarks), that
  many processes are spawned, one thread each, as ``hf-elixir launch`` would start them;
- otherwise (one rank, or a GPU, whose ranks do not share compute) in this process.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hf_elixir.hardware import ComputeFigures
from hf_elixir.measure import calibrate
from hf_elixir.planner.pricing import price
from hf_elixir.profile.memory import loss_of
from hf_elixir.profile.trace import build_meta_model, make_batch, rebind_patched_forwards
from hf_elixir.vocab import torch_dtype as _torch_dtype
from hf_elixir.runtime.host_memory import keep_freed_host_memory

#: a model whose priced step (on this device) is at most this many seconds is timed whole;
#: a larger one with copies priced at most this many seconds a step (module docstring)
WHOLE_STEP_SECONDS = 4.0
#: timed steps per model, after one warm-up; a fixed count, so ranks stay in step
REPEAT = 5
#: a whole copy is timed only when its parameters, gradients and activations take at most this
#: share of the device's memory
MEMORY_SHARE = 0.25


@dataclass
class ModelEfficiency:
    """Measured over priced compute time of one model's forward and backward.

    Attributes:
        efficiency: the ratio the cost model multiplies its per-operator prices by.
        measured_s, priced_s: the step (extrapolated to every block when ``blocks_timed``
            is not all of them) as measured and as priced at efficiency 1.
        blocks: transformer blocks in the model; ``blocks_timed``: in the copies timed.
        ranks: processes that timed at once.
        seconds: wall time the measurement took.
    """

    efficiency: float
    measured_s: float
    priced_s: float
    blocks: int
    blocks_timed: list[int]
    ranks: int
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"efficiency": self.efficiency, "measured_s": self.measured_s, "priced_s": self.priced_s,
                "blocks": self.blocks, "blocks_timed": list(self.blocks_timed), "ranks": self.ranks,
                "seconds": self.seconds}


# ---------------------------------------------------------------------- a model with fewer blocks
def block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's transformer blocks: its ``nn.ModuleList`` of same-class modules holding
    the most parameters (experts' lists inside a block hold fewer than the blocks'), or None."""
    best, best_size = None, 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            continue
        if len({type(c) for c in m}) != 1:
            continue
        size = sum(p.numel() for p in m.parameters())
        if size > best_size:
            best, best_size = (name, m), size
    return best


def reduced_copy(model: nn.Module, keep: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A real copy of ``model`` on ``device`` with only its first ``keep`` blocks.

    The dropped blocks are never copied (they become meta tensors, then are cut out); the kept
    parameters and buffers are copied with their values, so buffers a constructor computed
    (rotary frequencies, causal masks) stay right. A config with a block count is told the new
    count, for models that read it in ``forward``.
    """
    found = block_list(model)
    if found is None:
        raise ValueError(f"{type(model).__name__} has no list of blocks to shorten")
    name, blocks = found
    keep = max(1, min(keep, len(blocks)))
    dropped = {id(t) for b in list(blocks)[keep:] for t in [*b.parameters(), *b.buffers()]}
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) in dropped:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        else:
            data = p.detach().to(device=device, dtype=dtype if p.is_floating_point() else p.dtype, copy=True)
            memo[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta") if id(b) in dropped else b.detach().to(device, copy=True)
    out = copy.deepcopy(model, memo)
    rebind_patched_forwards(model, out, memo)  # a forward TRL patched must run this copy
    shortened = nn.ModuleList(list(out.get_submodule(name))[:keep])
    parent, _, attr = name.rpartition(".")
    setattr(out.get_submodule(parent) if parent else out, attr, shortened)
    config = getattr(out, "config", None)
    if config is not None and isinstance(getattr(config, "num_hidden_layers", None), int):
        try:
            config.num_hidden_layers = keep
            for key in ("layer_types", "mlp_only_layers"):
                value = getattr(config, key, None)
                if isinstance(value, list) and len(value) == len(blocks):
                    setattr(config, key, value[:keep])
        except Exception:  # a config that refuses the new count: the shortened list still runs
            pass
    out.train()
    return out


def _source(model_or_config: Any, layers: int | None) -> nn.Module:
    """A real model to shorten: the module itself, or one built (on the CPU, randomly
    initialised) from a transformers config, with only ``layers`` blocks (None: all)."""
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model_or_config)
    if layers is not None:
        if not isinstance(getattr(config, "num_hidden_layers", None), int):
            raise ValueError(f"{type(config).__name__} has no num_hidden_layers to shorten")
        config.num_hidden_layers = min(layers, config.num_hidden_layers)
    return AutoModelForCausalLM.from_config(config)


# ---------------------------------------------------------------------- pricing and timing
def _stepper(model: nn.Module, batch_shape: tuple[int, int]) -> Callable[[], None]:
    """One forward and backward of ``model`` on a random batch, gradients dropped after."""
    device = next(model.parameters()).device
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    batch = make_batch(batch_shape, vocab, device=device)

    def step() -> None:
        loss_of(model(**batch)).backward()
        for p in model.parameters():
            p.grad = None

    return step


def time_steps(models: list[nn.Module], batch_shape: tuple[int, int], before: Callable[[], object] | None = None,
               repeat: int = REPEAT) -> list[float]:
    """Median seconds of each model's forward-and-backward step over ``repeat`` rounds, after
    a warm-up round; within a round the models take turns, so that a drift of the machine's
    speed (10-30% within minutes on a shared VM) falls on each alike. ``before`` runs ahead of
    each step, untimed (a barrier, so that ranks time together)."""
    steps = [_stepper(m, batch_shape) for m in models]
    sync = torch.cuda.synchronize if any(next(m.parameters()).device.type == "cuda" for m in models) else None
    times: list[list[float]] = [[] for _ in models]
    for i in range(repeat + 1):  # the first round is a warm-up
        for step, out in zip(steps, times):
            if before is not None:
                before()
            t = time.perf_counter()
            step()
            if sync:
                sync()
            if i:
                out.append(time.perf_counter() - t)
    return [statistics.median(t) if t else 0.0 for t in times]


# ---------------------------------------------------------------------- where the ranks run
def _dist_group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _everywhere(ok: bool, ranks: int) -> bool:
    """Whether ``ok`` holds on every rank of the running job (so that all time, or none)."""
    if ranks <= 1:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _time_in_job(models: list[nn.Module], batch_shape) -> list[float]:
    """Every rank of the running job times its copies at once; the mean over ranks."""
    import torch.distributed as dist

    times = torch.tensor(time_steps(models, batch_shape, before=dist.barrier), dtype=torch.float64)
    if dist.get_backend() == "nccl":
        times = times.cuda()
    dist.all_reduce(times)
    return (times.cpu() / dist.get_world_size()).tolist()


def _pair_worker(rank: int, world: int, port: int, models, batch_shape, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    keep_freed_host_memory()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        times = _time_in_job(models, batch_shape)
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


def _time_spawned(models: list[nn.Module], batch_shape, ranks: int, timeout: float) -> list[float] | None:
    """``ranks`` CPU processes, one thread each, time the copies at once (the mean over ranks)."""
    times, codes = calibrate.run_local_ranks(_pair_worker, (models, batch_shape), ranks, timeout)
    if times is None:
        warnings.warn(f"hf_elixir: timing the model in {ranks} processes failed (exit codes {codes}); "
                      "its plan is priced with the calibrated efficiency instead", stacklevel=3)
    return times


# ---------------------------------------------------------------------- entry point
def _trial_price(source: nn.Module, keep: int, batch_shape: tuple[int, int], figs: ComputeFigures,
                 device: torch.device, dtype: str) -> float:
    """The price at efficiency 1 of a copy of ``source`` with ``keep`` blocks, after one
    step of it: a copy that cannot train is never timed (it raises here)."""
    trial = reduced_copy(source, keep, device, _torch_dtype(dtype))
    priced = price(calibrate.step_work(trial, batch_shape, device.type), figs, dtype, efficiency=1.0)
    time_steps([trial], batch_shape, repeat=0)
    return priced


def _longest(prices: list[float], blocks: int, budget: float) -> int:
    """The most blocks (2 at least, fewer than all) whose copy is priced within ``budget``
    seconds a step, from the one- and two-block prices: the per-block increment of the
    extrapolation is a difference of two timings, so the more blocks it spans, the less the
    timings' noise is multiplied on the way to the whole model."""
    p1, p2 = prices
    if p2 <= p1:
        return 2
    return max(2, min(blocks - 1, 1 + int((budget - p1) // (p2 - p1))))


def measure(model_or_config: Any, batch_shape: tuple[int, int], figs: ComputeFigures,
            device: torch.device, dtype: str = "float32", ranks_per_node: int = 1,
            priced_whole: float | None = None, device_memory: float | None = None,
            whole_step_seconds: float = WHOLE_STEP_SECONDS, timeout: float = 300.0) -> ModelEfficiency | None:
    """This model's efficiency at ``batch_shape`` on ``device``, or None when it cannot be
    timed (no list of blocks, or the timing failed: a warning says which).

    Args:
        model_or_config: an ``nn.Module`` (copied, never changed) or a transformers config.
        figs: the figures its step is priced with (their own efficiency is not used).
        dtype: the compute dtype ("float32", "bfloat16", "float16").
        ranks_per_node: ranks that will share this node (CPU ranks are timed that many at once).
        priced_whole: the whole step's price at efficiency 1, when the caller has it: a model
            priced at most ``whole_step_seconds`` is timed whole (None: shortened copies).
        device_memory: bytes of device memory, of which a whole copy may take ``MEMORY_SHARE``.
    """
    t0 = time.perf_counter()
    meta = build_meta_model(model_or_config, dtype)
    found = block_list(meta)
    if found is None:
        return None
    blocks = len(found[1])
    torch_dtype = _torch_dtype(dtype)
    n_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
    fits = device_memory is None or 3 * n_bytes <= MEMORY_SHARE * device_memory
    cheap = priced_whole is not None and priced_whole <= whole_step_seconds
    options = [[blocks]] if fits and cheap else [[1, 2]] + ([[blocks]] if fits else [])
    models, prices, failures = [], [], []
    for keeps in options:
        try:
            source = _source(model_or_config, None if keeps == [blocks] else max(keeps))
            prices = [_trial_price(source, k, batch_shape, figs, device, dtype) for k in keeps]
            if keeps == [1, 2]:  # as many blocks as the budget of a whole step allows
                longest = _longest(prices, blocks, whole_step_seconds)
                if longest > 2:
                    keeps = [1, longest]
                    source = _source(model_or_config, longest)
                    prices[1] = _trial_price(source, longest, batch_shape, figs, device, dtype)
            # fresh copies for the timing: some models keep tensors of their last step as
            # attributes, which neither a deep copy nor a spawned process can take
            models = [reduced_copy(source, k, device, torch_dtype) for k in keeps]
            break
        except Exception as e:  # e.g. blocks that read state an earlier, dropped block set
            failures.append(f"{keeps}: {type(e).__name__}: {str(e)[:200]}")
            models = []
    in_job = _dist_group_size()
    if not _everywhere(bool(models), in_job):
        reason = "; ".join(failures) or "it failed on another rank"
        warnings.warn(f"hf_elixir: cannot time {type(meta).__name__} at batch {tuple(batch_shape)} "
                      f"({reason}); its plan is priced with the calibrated efficiency", stacklevel=2)
        return None
    whole = keeps == [blocks]
    if in_job > 1:
        times, ranks = _time_in_job(models, batch_shape), in_job
    elif device.type == "cpu" and ranks_per_node > 1:
        times, ranks = _time_spawned(models, batch_shape, ranks_per_node, timeout), ranks_per_node
        if times is None:
            return None
    else:
        times, ranks = time_steps(models, batch_shape), 1
    if whole:
        m, p = times[0], prices[0]
    else:
        (m1, mk), (p1, pk), k = times, prices, keeps[1]
        # the price follows the prices alone, so timing noise never changes what is priced
        p = p1 + (blocks - 1) / (k - 1) * (pk - p1) if pk > p1 else pk * blocks / k
        if mk > m1 and pk > p1:
            m = m1 + (blocks - 1) / (k - 1) * (mk - m1)
        else:  # timing noise larger than the blocks: the longer copy's own ratio
            m = p * mk / pk
    return ModelEfficiency(efficiency=m / p, measured_s=m, priced_s=p, blocks=blocks, blocks_timed=keeps,
                           ranks=ranks, seconds=time.perf_counter() - t0)
