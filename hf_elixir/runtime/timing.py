"""Where a training step's time goes, measured on every step at negligible cost.

The runtime marks the points where its work begins and ends: a training forward, the end
of a backward, a wait for a gather or a reduction, the gradient norm, the optimizer's
updates and copies. On a CPU a mark is ``time.perf_counter()``; on a CUDA device, phases
that run on the compute stream are timed by CUDA events recorded on it (a few microseconds
each, read once the step's work has finished), so a stall of the stream behind a gather or
an upload is measured where it happens, not where the host waited. Host work (the host
optimizer, casts into staging buffers) is always timed on the host.

Phases carry the planner's names (``plan.predictions["time"]``, ``planner/search.py``), so
``ElixirModule.time_report()`` puts each measured figure beside its prediction:

- ``forward_backward``: the training passes, from each forward's start to its backward's
  end, summed over the micro-batches of the step.
- ``exposed_communication``: the part of those passes spent waiting for gathers (fetches)
  and gradient reductions; ``compute`` is the rest of the passes.
- ``pcie``: waits for gradient downloads and host-buffer uploads (CUDA only).
- ``clip``: the global gradient norm and the scaling of gradients for clipping.
- ``device_optimizer`` / ``cpu_optimizer``: the optimizer's updates of shards whose state
  the plan put on the device / on the host.
- ``host_copies``: publishing updated weights: the compute-dtype copies of master shards
  (casts into staging buffers on a GPU) and their uploads' start.
- ``background``: the part of ``cpu_optimizer`` and ``host_copies`` done on the host
  update thread (runtime/host_update.py) while the main thread went on; ``exposed_cpu`` the
  time the main thread waited for it, and ``overlap`` the rest: host work hidden behind
  the next forward. The thread's work is charged to the step in which it ends.
- ``optimizer_other``: the rest of ``step()`` (the agreement on which parameters had
  gradients, dropping gathered chunks, starting the next pass's prefetch).
- ``zero_grad``: clearing the gradient shards (a pass over them; a script calls it between
  steps, so it is charged to the step that follows).
- ``step``: from the first forward of the step to the end of ``step()``, plus ``zero_grad``
  when it ran before that forward; ``outside`` is what the runtime did not see (the
  script's own work between its calls: data loading, logging).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

#: the phases of a step, in the order a report lists them
PHASES = ("forward_backward", "compute", "exposed_communication", "pcie", "clip", "device_optimizer",
          "cpu_optimizer", "host_copies", "background", "exposed_cpu", "overlap", "optimizer_other", "zero_grad",
          "outside", "step")
#: the phases that together make up a step, less ``background`` (``compute`` and
#: ``exposed_communication`` split ``forward_backward``; ``outside`` is the remainder)
PARTS = ("forward_backward", "pcie", "clip", "device_optimizer", "cpu_optimizer", "host_copies",
         "optimizer_other", "zero_grad")
#: steps whose breakdowns are kept for the report
KEPT_STEPS = 200

Mark = Any  # a perf_counter() float, or a CUDA event recorded on the compute stream


@dataclass
class _Open:
    """The step being measured: host seconds by phase, and device intervals to read later."""

    start: Mark
    host: dict[str, float] = field(default_factory=dict)
    device: list[tuple[str, Mark, Mark]] = field(default_factory=list)
    micro_batches: int = 0
    pass_start: Optional[Mark] = None
    #: host seconds charged before the step opened (its zero_grad), outside its interval
    carried: float = 0.0


class StepClock:
    """Per-step breakdown of a runtime's time (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self.device = device
        self._open: Optional[_Open] = None
        #: host time charged while no step was open (``zero_grad`` after a step), for the next
        self._carry: dict[str, float] = {}
        self._pending: deque[_Open] = deque()
        self._done: deque[dict[str, float]] = deque(maxlen=KEPT_STEPS)

    # ------------------------------------------------------------------ marks
    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def mark(self) -> Mark:
        """A point on the compute timeline: an event on the current stream (CUDA), else now."""
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    # ------------------------------------------------------------------ recording
    def begin_pass(self) -> None:
        """A training forward starts (opens the step on its first micro-batch)."""
        mark = self.mark()
        if self._open is None:
            self._open = _Open(start=mark, host=self._carry, carried=sum(self._carry.values()))
            self._carry = {}
        self._open.pass_start = mark

    def end_pass(self) -> None:
        """A backward ended: the pass since ``begin_pass`` is one micro-batch's."""
        step = self._open
        if step is None or step.pass_start is None:
            return
        self._interval(step, "forward_backward", step.pass_start, self.mark())
        step.pass_start = None
        step.micro_batches += 1

    def device_phase(self, phase: str, start: Mark) -> None:
        """Charge ``phase`` from ``start`` (a ``mark()``) to now, on the compute timeline."""
        if self._open is not None:
            self._interval(self._open, phase, start, self.mark())

    def host_phase(self, phase: str, start: float) -> None:
        """Charge ``phase`` from ``start`` (a ``now()``) to now, on the host; with no step
        open, to the next step."""
        host = self._open.host if self._open is not None else self._carry
        host[phase] = host.get(phase, 0.0) + time.perf_counter() - start

    def interval(self) -> Optional[tuple[_Open, float, float]]:
        """The start of a host interval whose unmarked time ``charge_rest`` will charge: the
        open step, what its phases hold now, and now (None: no step open, or on CUDA)."""
        if self._open is None or self.events:
            return None
        return self._open, sum(self._open.host.values()), time.perf_counter()

    def charge_rest(self, phase: str, interval: Optional[tuple[_Open, float, float]]) -> None:
        """Charge ``phase`` with the part of ``interval`` (from ``interval()``) up to now that
        no phase was charged with meanwhile: the bookkeeping between a call's marks. CPU
        only: on CUDA the step is timed on the compute stream, where host bookkeeping the
        device does not wait for takes no time."""
        if interval is None or interval[0] is not self._open:
            return
        step, charged, start = interval
        rest = time.perf_counter() - start - (sum(step.host.values()) - charged)
        if rest > 0:
            step.host[phase] = step.host.get(phase, 0.0) + rest

    def end_step(self, background: Optional[dict[str, float]] = None) -> None:
        """The optimizer step is over: close the step (read on a later report).
        ``background``: seconds by phase of work on other threads that ended meanwhile."""
        step = self._open
        if step is None:
            return
        self._open = None
        for phase, seconds in (background or {}).items():
            step.host[phase] = step.host.get(phase, 0.0) + seconds
        self._interval(step, "step", step.start, self.mark())
        self._pending.append(step)
        self._resolve(wait=False)


    def _interval(self, step: _Open, phase: str, start: Mark, end: Mark) -> None:
        if self.events:
            step.device.append((phase, start, end))
        else:
            step.host[phase] = step.host.get(phase, 0.0) + end - start

    # ------------------------------------------------------------------ reading
    def _resolve(self, wait: bool) -> None:
        """Turn finished steps into breakdowns; ``wait``: finish their events first."""
        while self._pending:
            step = self._pending[0]
            if step.device:
                last = step.device[-1][2]
                if not wait and not last.query():
                    return
                last.synchronize()
            self._pending.popleft()
            seconds = dict(step.host)
            for phase, start, end in step.device:
                seconds[phase] = seconds.get(phase, 0.0) + start.elapsed_time(end) / 1e3
            # work charged before the step's first forward (its zero_grad) is part of the step
            seconds["step"] = seconds.get("step", 0.0) + step.carried
            self._done.append(_breakdown(seconds, step.micro_batches))

    def steps(self) -> list[dict[str, float]]:
        """The breakdowns of the measured steps, oldest first (at most KEPT_STEPS)."""
        self._resolve(wait=True)
        return list(self._done)

    def reset(self) -> None:
        self._resolve(wait=True)
        self._done.clear()
        self._carry = {}


def _breakdown(seconds: dict[str, float], micro_batches: int) -> dict[str, float]:
    derived = ("compute", "overlap", "outside")
    out = {phase: seconds.get(phase, 0.0) for phase in PHASES if phase not in derived}
    stalled = out["exposed_communication"] + seconds.get("exposed_cpu_in_passes", 0.0)
    out["compute"] = max(0.0, out["forward_backward"] - stalled)
    out["overlap"] = max(0.0, out["background"] - out["exposed_cpu"])
    out["outside"] = max(0.0, out["step"] - main_thread(out))
    out["micro_batches"] = float(micro_batches)
    return out


def main_thread(step: dict[str, float]) -> float:
    """The seconds of a step's phases spent on the main thread (what adds up to its wall)."""
    return sum(step[p] for p in PARTS) - step.get("background", 0.0)


#: predicted phases that every micro-batch's passes repeat; the rest happen once a step
PER_PASS = ("forward_backward", "compute", "collectives", "exposed_communication")


def predicted_for(predicted: dict[str, float], micro_batches: float) -> dict[str, float]:
    """The plan's figures (one step of one micro-batch) for a step of ``micro_batches``:
    the passes run that many times, the optimizer's work once. Without this a measured step
    of two micro-batches stood beside a one-micro-batch prediction, and read as the planner
    being twice off."""
    n = max(1, round(micro_batches))
    out = dict(predicted)
    for phase in PER_PASS:
        if phase in out:
            out[phase] = predicted[phase] * n
    if "step" in out and "forward_backward" in predicted:
        out["step"] = predicted["step"] + (n - 1) * predicted["forward_backward"]
    return out


def summarize(steps: list[dict[str, float]], predicted: Optional[dict[str, float]] = None,
              skip_first: int = 1) -> dict[str, Any]:
    """The report of ``time_report()``: the mean of each phase over the measured steps (the
    first ``skip_first`` left out when more remain: the first step records the trace, warms
    caches and compiles what torch.compile compiles), the last step's, and the plan's
    prediction for a step of the measured micro-batches (``predicted_for``; the plan's own,
    for one micro-batch, is ``predicted_one_micro_batch``). ``first_step`` is the first
    step's seconds and ``warmup`` what it took beyond the steady step's mean."""
    used = steps[skip_first:] if len(steps) > skip_first else steps
    mean = {p: sum(s[p] for s in used) / len(used) for p in (*PHASES, "micro_batches")} if used else {}
    first = steps[0]["step"] if steps else None
    warmup = max(0.0, first - mean["step"]) if steps and len(steps) > skip_first else None
    return {"steps": len(used), "measured": mean, "last": steps[-1] if steps else {},
            "predicted": predicted_for(predicted or {}, mean.get("micro_batches", 1.0)),
            "predicted_one_micro_batch": dict(predicted or {}), "first_step": first, "warmup": warmup}


def format_report(report: dict[str, Any]) -> str:
    """The report as a table, one phase a line: measured (ms), predicted (ms), share of the step."""
    measured, predicted = report.get("measured") or {}, report.get("predicted") or {}
    if not measured:
        return "no training step measured yet"
    step = measured.get("step") or 0.0
    lines = [f"step time by phase (mean of {report['steps']} step(s), "
             f"{measured.get('micro_batches', 1):.0f} micro-batch(es) each), predicted for as many"
             + (f"; the first step, left out, took {report['first_step'] * 1e3:.2f} ms, {report['warmup'] * 1e3:.2f} ms "
                "above the steady step (the trace's recording, first allocations, torch.compile's compiling)"
                if report.get("warmup") is not None else ""),
             f"  {'phase':<22}{'measured ms':>12}{'predicted ms':>14}{'of step':>9}"]
    for phase in PHASES:
        value = measured.get(phase, 0.0)
        if not value and phase not in ("step", "forward_backward"):
            continue
        guess = predicted.get(phase)
        guess_text = f"{guess * 1e3:>14.2f}" if guess is not None else f"{'-':>14}"
        share = f"{value / step:>8.0%}" if step else ""
        lines.append(f"  {phase:<22}{value * 1e3:>12.2f}{guess_text}{share}")
    return "\n".join(lines)
