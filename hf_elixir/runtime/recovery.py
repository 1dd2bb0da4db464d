"""Out-of-memory recovery: a failed step becomes a re-plan and a redo, on every rank at once.

A step fails where the memory runs out, on one rank or several:

1. **Finish the pass.** A rank whose training forward or backward raises
   ``torch.OutOfMemoryError`` releases what the pass held and finishes the pass hollowly
   (schedule.py), so its peers never wait in a collective it abandoned. The backward's last
   all-reduce carries the failure to every rank; from then on the rest of the step's
   micro-batches are only recorded, not run (every rank knows, so none issues a collective
   the others skip). A failing forward returns a stand-in output whose loss is NaN.
2. **Agree at the step.** ``ElixirOptimizer.step`` all-reduces, as it always did, which
   parameters got gradients; one more element of that tensor says whether any rank failed
   since the last step, so failures after the backward's agreement are caught too.
3. **Re-plan, adopt, redo.** Every rank asks the same re-planner for a plan that needs less
   memory and keeps the packing (``planner.replan``), adopts it in place (no shard moves),
   clears the step's gradients and runs the step's micro-batches again from the inputs it
   recorded, with the loss scaled as the script scaled it, then updates. The step's result
   is the one the new plan gives from that step on; no earlier step is repeated or lost.

After ``max_attempts`` failed recoveries, or when the ladder has no lever left, the error
is raised (``RecoveryFailed``) with what was tried, and nothing saved is touched.

A step can be redone only when the loss handed to ``backward`` is the model output's own
loss times a constant (``accelerator.backward(outputs.loss)``, the Trainer's scaling):
that is how the redo recomputes it. A failure in a pass that starts from a state no earlier
pass started from (the first passes of a run, the first after an evaluation or a re-plan)
cannot be finished hollowly (schedule.py) and is raised.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from hf_elixir.planner.record import ElixirPlan, PlanError
from hf_elixir.planner.replan import memory_target, same_packing, tighten
from hf_elixir.profile.profiler import disable_checkpointing, enable_checkpointing, model_checkpoints
from hf_elixir.runtime.block_policies import check_block_policies, uses_checkpointing
from hf_elixir.runtime.cache import RCache
from hf_elixir.runtime.chunk import ChunkState
from hf_elixir.runtime.faults import FaultInjector
from hf_elixir.runtime.reduce import FAILED, REPLAN
from hf_elixir.runtime.schedule import ScheduleUnknown
from hf_elixir.vocab import HfElixirError, format_bytes

log = logging.getLogger("hf_elixir")

#: how many recoveries one run may make before the error is raised
MAX_ATTEMPTS = 3
#: training forwards recorded per step at most: a loop that never steps the ElixirOptimizer
#: (a probe, a custom loop) must not hold its inputs for ever
MAX_RECORDED = 256

Replanner = Callable[[ElixirPlan, int], Optional[ElixirPlan]]


class RecoveryFailed(HfElixirError, RuntimeError):
    pass


@dataclass
class MicroBatch:
    """One training forward of the current step: its inputs and how its loss was scaled."""

    args: tuple
    kwargs: dict
    link: Optional["LossLink"] = None  #: how the loss given to backward followed from the model's
    stand_in: bool = False             #: its forward did not run on this rank
    split: int = 1                     #: the plan's micro-batch split when it ran

    def factor(self) -> Optional[float]:
        return self.link.factor() if self.link is not None else None


class BatchSplitter(Protocol):
    """What an integration that can run a batch as smaller micro-batches gives the runtime
    (the Trainer's, ``integrations/microbatch.py``): the micro-batch lever of a re-plan."""

    def can_split(self, split: int) -> bool:
        """Whether every batch can run as ``split`` micro-batches."""

    def split(self, batch: MicroBatch, parts: int) -> list[tuple[MicroBatch, float]]:
        """``batch`` as ``parts`` micro-batches, each with the weight its loss takes in the
        step, as a run started with the smaller micro-batch would have scaled it."""


@dataclass
class RecoveryLog:
    """What recoveries happened (tests and the summary read it)."""

    events: list[dict] = field(default_factory=list)


def model_loss(output: Any) -> Optional[torch.Tensor]:
    """The loss a model's output carries, as the Trainer reads it (``.loss``, ``["loss"]``,
    the first element), or the output itself when it is a scalar tensor."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


@dataclass
class Origin:
    """The model's loss as a forward returned it: the tensor, its graph node and its value
    then (a script may scale it in place, as the Trainer does)."""

    tensor: torch.Tensor
    node: Any
    value: torch.Tensor


@dataclass
class LossLink:
    """How the loss given to backward followed from the model's loss, kept as device scalars
    (reading them would wait for the device): the gradient of the one by the other, both
    values, the model loss's value when its forward returned, and whether every in-place
    change of it since was a scaling."""

    grad: torch.Tensor
    loss: torch.Tensor
    source: torch.Tensor
    original: torch.Tensor
    scaled_in_place: bool

    def factor(self) -> Optional[float]:
        """``c`` with loss == c * (the model's loss as returned), else None."""
        if not self.scaled_in_place:
            return None
        g, value, now, then = (float(t) for t in (self.grad, self.loss, self.source, self.original))
        if not all(math.isfinite(v) for v in (g, value, now, then)) or then == 0:
            return None
        if not math.isclose(value, g * now, rel_tol=1e-5, abs_tol=1e-12):
            return None  # not a constant scaling: the redo could not rebuild this loss
        return g * now / then


def origin_of(loss: torch.Tensor) -> Origin:
    return Origin(loss, loss.grad_fn, loss.detach().clone())


def link_loss(loss: torch.Tensor, origin: Origin) -> Optional[LossLink]:
    """How ``loss`` depends on the model's loss ``origin`` (None: it does not)."""
    source = origin.tensor
    if not (loss.requires_grad and source.requires_grad):
        return None
    (grad,) = torch.autograd.grad(loss, source, retain_graph=True, allow_unused=True)
    if grad is None:
        return None
    return LossLink(grad.detach(), loss.detach().clone(), source.detach().clone(), origin.value,
                    _scalings_only(source.grad_fn, origin.node))


def _scalings_only(node: Any, origin: Any, limit: int = 8) -> bool:
    """Whether the graph from ``node`` down to ``origin`` is only multiplications or divisions
    by constants (what in-place scaling of a loss records)."""
    for _ in range(limit + 1):
        if node is origin:
            return True
        if node is None or node.name() not in ("MulBackward0", "DivBackward0"):
            return False
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


class Recovery:
    """The recovery state of one ElixirModule (see the module docstring)."""

    def __init__(self, module: Any, replanner: Optional[Replanner] = None,
                 max_attempts: int = MAX_ATTEMPTS, enabled: bool = True) -> None:
        self._module = weakref.ref(module)
        self.enabled = enabled
        self.injector = FaultInjector.from_env(module.comm.rank)
        self.replanner = replanner
        self.max_attempts = max_attempts
        self.attempts = 0
        self.step = 0                      #: optimizer steps taken
        self.step_failed = False           #: this rank knows the current step failed
        self.batches: list[MicroBatch] = []
        self.overflowed = False            #: more forwards than MAX_RECORDED since the last step
        #: a clip asked for in a failed step, applied after its redo: (max_norm, norm_type)
        self.pending_clip: Optional[tuple[float, float]] = None
        self.redoing = False
        #: the latest training forward's loss: held (a scalar) until the step, because the
        #: script usually keeps only a scaled copy of it, and the factor is measured against it
        self._origin: Optional[Origin] = None
        self._last_link: Optional[LossLink] = None  #: the last step's, for a stand-in's scaling
        self._last_output_type: Optional[type] = None
        #: set by an integration that can split batches (the micro-batch lever)
        self.splitter: Optional[BatchSplitter] = None
        #: the memory this process could have had when it failed (CUDA only), for the re-plan
        self._available: Optional[float] = None
        #: what the redone stand-ins' losses came to (scaled as the script scaled them), and
        #: the norm a pending clip measured after the redo: a trainer that logged a stand-in's
        #: loss or a failed step's norm takes them (``take_redone``)
        self._owed_loss: Optional[torch.Tensor] = None
        self._redone_norm: Optional[torch.Tensor] = None
        self.log = RecoveryLog()

    @property
    def module(self) -> Any:
        return self._module()

    # ------------------------------------------------------------------ fault injection
    def check(self, phase: str) -> None:
        if self.injector is not None and not self.redoing:
            self.injector.check(self.step, phase)

    # ------------------------------------------------------------------ the forward
    def run_forward(self, call: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        """A training forward: recorded, run (or skipped when the step already failed), and,
        when it fails, finished hollowly."""
        m = self.module
        if not self.redoing:
            if len(self.batches) >= MAX_RECORDED:
                self.batches.clear()
                self.overflowed = True
            self.batches.append(MicroBatch(args, kwargs, split=m.plan.micro_batch_split))
        if self.step_failed:
            return self._stand_in()
        m.comm.schedule.begin(start_state(m))
        try:
            output = call()
        except torch.OutOfMemoryError as exc:
            self._finish_failed_pass(exc, "forward")
            return self._stand_in()
        loss = model_loss(output)
        self._origin = origin_of(loss) if loss is not None and loss.requires_grad else None
        self._last_output_type = type(output)
        return output

    def _stand_in(self) -> Any:
        """An output for a forward that did not run: its loss is NaN (logged as such; the
        step is redone before the optimizer updates anything)."""
        # not a leaf: scripts scale the loss in place (the Trainer does), which a leaf refuses
        loss = torch.full((), float("nan"), device=self.module.device, requires_grad=True) * 1.0
        self._origin = origin_of(loss)
        if self.batches and not self.redoing:
            self.batches[-1].stand_in = True
        kind = self._last_output_type
        if kind is None or issubclass(kind, torch.Tensor):
            return loss
        try:
            return kind(loss=loss)
        except TypeError:
            return (loss,)

    # ------------------------------------------------------------------ the backward
    def before_backward(self, loss: torch.Tensor) -> bool:
        """Note how ``loss`` scales the model's loss; False: skip this backward (its step
        failed, it will be redone)."""
        origin, self._origin = self._origin, None
        if self.batches and not self.redoing:
            self.batches[-1].link = link_loss(loss, origin) if origin is not None else None
        return not self.step_failed

    def failed_in_backward(self, exc: torch.OutOfMemoryError) -> None:
        self._finish_failed_pass(exc, "backward")

    def after_backward(self, agreed: int) -> None:
        """Every rank, at the end of every backward: keep the pass's schedule, or, when a rank
        reported a failure, drop it and every gathered chunk (every rank the same)."""
        m = self.module
        if agreed == FAILED:
            m.comm.schedule.end(keep=False)
            m.fetcher.free_all()
            if not self.step_failed:
                self._note_failure("elsewhere", remote=True)
        else:
            m.comm.schedule.end(keep=True)

    # ------------------------------------------------------------------ failing
    def _finish_failed_pass(self, exc: torch.OutOfMemoryError, phase: str) -> None:
        m = self.module
        if not self.enabled:
            raise exc
        try:
            if m.comm.distributed:  # alone, no peer waits for anything
                m.comm.schedule.finish_hollow(m.comm, FAILED)
        except ScheduleUnknown as why:
            raise RecoveryFailed(
                f"hf_elixir: out of memory in the {phase} of step {self.step} on rank {m.comm.rank}, "
                f"and it cannot be recovered: {why} (a failure in the first pass from a state, such as "
                f"the first passes of a run or those right after a re-plan, is raised as it is). "
                f"{_needed(m.plan)}Make a plan with a smaller memory_budget, or use a smaller batch") from exc
        m.hooks.abandon_pass()
        m.fetcher.free_all()
        if m.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(m.device)
            self._available = float(free + torch.cuda.memory_reserved(m.device))
            torch.cuda.empty_cache()
        self._note_failure(phase, remote=False, error=str(exc))

    def _note_failure(self, phase: str, remote: bool, error: str = "") -> None:
        self.step_failed = True
        self.log.events.append({"step": self.step, "phase": phase, "rank": self.module.comm.rank,
                                "here": not remote, "error": error})

    # ------------------------------------------------------------------ the step
    def recover(self, redo: Callable[[MicroBatch, float], torch.Tensor]) -> None:
        """Every rank: re-plan, adopt the plan, clear the step's gradients, redo its
        micro-batches (``redo`` runs one forward and a backward of its loss times the factor,
        and returns that scaled loss), each split as the new plan splits batches."""
        m = self.module
        self.attempts += 1
        old = m.plan
        failure = f"out of memory in step {self.step}"
        if self.attempts > self.max_attempts:
            raise RecoveryFailed(
                f"hf_elixir: {failure}, after {self.max_attempts} recoveries "
                f"({'; '.join(e.get('change', '?') for e in self.log.events if 'change' in e)}). "
                f"{_needed(old)}More memory per device, a smaller batch or more offload "
                "(offload: all) is needed. Nothing saved was touched")
        factors = [None if b.stand_in else b.factor() for b in self.batches]
        known = [f for f in factors if f is not None]
        # a stand-in's loss had no value to measure a scaling by: the script scales every
        # micro-batch alike, so it takes one measured in this step or the last
        fallback = known[-1] if known else (self._last_link.factor() if self._last_link is not None else None)
        factors = [fallback if b.stand_in else f for b, f in zip(self.batches, factors)]
        missing = [i for i, f in enumerate(factors) if f is None]
        if self.overflowed:
            raise RecoveryFailed(
                f"hf_elixir: {failure}; it cannot be redone: more than {MAX_RECORDED} training forwards ran "
                "since the last optimizer step, more than the runtime records. Step the optimizer more "
                "often, or turn recovery off (recover_oom: false)")
        if missing:
            raise RecoveryFailed(
                f"hf_elixir: {failure}; it cannot be redone because the loss given to backward for "
                f"micro-batch(es) {missing} is not the model output's loss times a constant. Pass "
                "outputs.loss (scaled as you like) to accelerator.backward, or turn recovery off "
                "(recover_oom: false)")
        new = (self.replanner or self._default_replanner)(old, self.attempts)
        if new is None:
            raise RecoveryFailed(
                f"hf_elixir: {failure} and no plan this run can move to is predicted to need less memory "
                f"(activation checkpointing {'on' if old.activation_checkpointing else 'unavailable'}, "
                f"micro-batch split {old.micro_batch_split}, rCache at {old.rcache_blocks} blocks, prefetch "
                f"{old.prefetch_depth}). {_needed(old)}More memory per device, a smaller batch or more "
                "offload (offload: all) is needed. Nothing saved was touched")
        m.adopt_plan(new)
        change = new.predictions.get("recovery", "re-planned")
        if self.log.events and "change" not in self.log.events[-1]:
            self.log.events[-1]["change"] = change
        else:
            self.log.events.append({"step": self.step, "phase": "elsewhere", "rank": m.comm.rank, "here": False,
                                    "change": change})
        if m.comm.rank == 0:
            log.warning("hf_elixir: %s; recovered with a new plan (%s), predicted step %s; redoing the "
                        "step from its %d micro-batch(es)", failure, change,
                        _seconds(new.predictions.get("step_time_s")), len(self.batches))
        self.step_failed = False
        self._available = None
        m.zero_grad()
        self.redoing = True
        owed = []
        try:
            for batch, factor in zip(self.batches, factors):
                losses = [redo(part, factor * weight) for part, weight in self._parts(batch, new)]
                if batch.stand_in:
                    owed.extend(losses)
        finally:
            self.redoing = False
        if owed:
            self._owed_loss = torch.stack([v.float() for v in owed]).sum()

    def _parts(self, batch: MicroBatch, plan: ElixirPlan) -> list[tuple[MicroBatch, float]]:
        """``batch`` as ``plan`` runs it: split further when the plan splits batches more than
        when it ran."""
        parts = plan.micro_batch_split // batch.split
        if parts <= 1:
            return [(batch, 1.0)]
        if self.splitter is None:
            raise RecoveryFailed("hf_elixir: the new plan splits batches, but nothing can split them here")
        return self.splitter.split(batch, parts)

    # ------------------------------------------------------------------ for a trainer's log
    def last_forward_stood_in(self) -> bool:
        """Whether the latest training forward returned a stand-in (its step failed)."""
        return bool(self.batches) and self.batches[-1].stand_in

    def note_redone_norm(self, norm: torch.Tensor) -> None:
        self._redone_norm = norm

    def take_redone(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(the redone stand-ins' scaled losses summed, the norm a clip measured after the
        redo), each None when there is none, and forget them."""
        out = (self._owed_loss, self._redone_norm)
        self._owed_loss = self._redone_norm = None
        return out

    def update_failed(self, exc: torch.OutOfMemoryError) -> None:
        """The optimizer step ran out of memory before it changed anything, on this rank: free
        what the allocator caches and go on (the other ranks may have updated already, so
        this step stays as it is), and ask every rank, at the next backward, to re-plan."""
        m = self.module
        if not self.enabled:
            raise exc
        if m.device.type == "cuda":
            torch.cuda.empty_cache()
        m.reducer.report = REPLAN
        self.log.events.append({"step": self.step, "phase": "optimizer", "rank": m.comm.rank, "here": True,
                                "error": str(exc)})

    def replan_only(self) -> None:
        """Every rank, at a step boundary, after a rank's optimizer step recovered on its own."""
        m = self.module
        self.attempts += 1
        new = None if self.attempts > self.max_attempts else (self.replanner or self._default_replanner)(
            m.plan, self.attempts)
        if new is None:
            if m.comm.rank == 0:
                log.warning("hf_elixir: an optimizer step ran out of memory and recovered, but no plan "
                            "needing less memory is left; going on with the current one")
            return
        m.adopt_plan(new)
        change = new.predictions.get("recovery", "re-planned")
        self.log.events.append({"step": self.step, "phase": "optimizer", "rank": m.comm.rank, "here": False,
                                "change": change})
        if m.comm.rank == 0:
            log.warning("hf_elixir: an optimizer step ran out of memory; new plan (%s), predicted step %s",
                        change, _seconds(new.predictions.get("step_time_s")))

    def _default_replanner(self, plan: ElixirPlan, attempt: int) -> Optional[ElixirPlan]:
        """The cheapest plan predicted to fit what this rank had (``replan.tighten``). Every
        rank must choose the same: the memory measured on one rank is agreed first."""
        m = self.module
        module = m.module
        can = hasattr(module, "gradient_checkpointing_enable") or hasattr(module, "activation_checkpointing_enable")
        available = self._available
        if m.comm.distributed and m.device.type == "cuda":
            # the least any rank could give; a rank that did not fail reports +inf
            value = torch.tensor([-(available if available is not None else math.inf)], dtype=torch.float64)
            available = -float(m.comm.all_reduce(value, op="max").item())
            available = None if math.isinf(available) else available
        target = memory_target(plan, attempt, available)
        return tighten(plan, can_checkpoint=can, can_split=self.splitter.can_split if self.splitter else None,
                       target=target)

    def stepped(self) -> None:
        self.step += 1
        self.pending_clip = None
        links = [b.link for b in self.batches if b.link is not None and not b.stand_in]
        if links:
            self._last_link = links[-1]
        self.batches.clear()
        self.overflowed = False
        self._origin = None


def start_state(m: Any) -> tuple:
    """What a pass's collectives depend on besides the model (schedule.py): the chunks that
    hold rCache blocks, in order of last use; those gathered, and those still in flight (a
    pass waits for those); whether the trace is known."""
    cache = m.cache
    resident = tuple(sorted(cache.resident, key=lambda c: cache.last_used.get(c, 0)))
    live = tuple((c.index, c.state.name) for c in m.chunks if c.state is not ChunkState.RELEASED)
    return resident, live, cache.trace is not None, len(m.fetcher.held)


def adopt_plan(m: Any, plan: ElixirPlan) -> None:
    """Move ElixirModule ``m`` to ``plan``, which packs and places every parameter as its
    current plan does: the new activation checkpointing and block policies, rCache and
    prefetch depth take effect at once, and no shard moves. Every gathered chunk is dropped first, so every rank
    starts the next pass from the same (empty) cache."""
    if not same_packing(m.plan, plan):
        raise PlanError("adopt_plan needs a plan with the same chunks and placements as the current one")
    plan.validate(m.module, world_size=m.comm.world_size)
    check_block_policies(m.module, plan)
    m.release_all()
    m.fetcher.free_all()
    m.block_policies.restore()
    if uses_checkpointing(plan) and not model_checkpoints(m.module):
        enable_checkpointing(m.module)
        m._own_checkpointing = True
    elif not uses_checkpointing(plan) and m._own_checkpointing:
        disable_checkpointing(m.module)
        m._own_checkpointing = False
    m.block_policies.apply(plan)
    m.cache = RCache(plan.rcache_blocks, agree=m.cache.agree)
    m.fetcher.cache = m.hooks.cache = m.cache
    m.fetcher.prefetch_depth = plan.prefetch_depth
    m.comm.schedule.forget()
    m.plan = plan


def _needed(plan: ElixirPlan) -> str:
    """What the plan was predicted to need per device and the least any plan needs, as
    sentences (a plan made without the search, ``ElixirPlan.simple``, has neither)."""
    p = plan.predictions
    said = ""
    peak = p.get("peak_bytes") or p.get("before_recovery", {}).get("peak_bytes")
    if peak:
        said += f"The plan that failed was predicted to need {format_bytes(peak)} per device. "
    smallest = p.get("smallest_peak_bytes")
    if smallest:
        said += (f"The smallest memory per device that would fit this model is {format_bytes(smallest)} "
                 f"at batch {p.get('batch_size', '?')} per device (any plan, offloading whatever it can)")
        one = p.get("smallest_peak_bytes_batch_1")
        said += f", {format_bytes(one)} at batch 1. " if one and one < smallest else ". "
    return said


def _seconds(value: Any) -> str:
    return f"{value:.3g} s" if isinstance(value, (int, float)) else "unknown"
