"""Measured training throughput next to the plan's prediction, reported after training.

The plan predicts one micro-step: forward and backward (``time["forward_backward"]``) and
the optimizer's share after it. A Trainer step with gradient accumulation ``a`` runs ``a``
forward-backward passes and one optimizer step, so its prediction is
``a * forward_backward + (step - forward_backward)``. The measurement is the median time
between the Trainer's ``on_step_begin`` and ``on_step_end`` over the steady steps (the first
few record the fetch trace and are left out). Below the line, rank 0 prints where its steps
spent their time, phase by phase beside the plan's prediction (``ElixirModule.time_report``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from transformers import TrainerCallback

from hf_elixir.runtime.timing import format_report, predicted_for

#: steps left out at the start: the first pass records the fetch trace, the next warm caches
WARMUP_STEPS = 2


def predicted_step_seconds(predictions: dict, accumulation: int) -> Optional[float]:
    """Seconds of one optimizer step with ``accumulation`` micro-batches, per the plan."""
    step = predictions.get("step_time_s")
    fb = predictions.get("time", {}).get("forward_backward")
    if step is None or fb is None:
        return None
    return predicted_for({"forward_backward": fb, "step": step}, accumulation)["step"]


@dataclass
class ThroughputReport:
    measured_tokens_per_s: float
    predicted_tokens_per_s: Optional[float]
    median_step_s: float
    steps: int
    #: the first steps, left out of the median: the trace's recording and torch.compile's compiling
    warmup_s: Optional[float] = None

    @property
    def error(self) -> Optional[float]:
        """Predicted over measured, minus one (+0.10: the plan was 10% optimistic)."""
        if not self.predicted_tokens_per_s:
            return None
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1

    def line(self) -> str:
        text = (f"hf_elixir throughput: {self.measured_tokens_per_s:,.0f} tokens/s measured "
                f"(median step {self.median_step_s * 1e3:.1f} ms over {self.steps} steps)")
        if self.predicted_tokens_per_s:
            text += f"; the plan predicted {self.predicted_tokens_per_s:,.0f} tokens/s ({self.error:+.0%})"
        if self.warmup_s is not None:
            text += (f"; the first {WARMUP_STEPS} step(s), left out, took {self.warmup_s:.2f} s "
                     f"({self.warmup_s - WARMUP_STEPS * self.median_step_s:+.2f} s beyond steady steps: "
                     "trace recording, compiling)")
        return text


@dataclass
class ThroughputCallback(TrainerCallback):
    """Times Trainer steps and, at the end of training, compares them with the plan.

    ``plan_of`` returns the running plan (None when hf_elixir is off); ``tokens_per_step``
    the tokens one optimizer step consumes on all ranks together; ``time_report_of`` the
    runtime's step breakdown (None: not printed).
    """

    plan_of: Callable[[], object] = None
    tokens_per_step: Callable[[], int] = None
    time_report_of: Optional[Callable[[], Optional[dict]]] = None
    report: Optional[ThroughputReport] = None
    _times: list[float] = field(default_factory=list)
    _warmup: float = 0.0
    _start: float = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > WARMUP_STEPS:
            self._times.append(time.perf_counter() - self._start)
        else:
            self._warmup += time.perf_counter() - self._start

    def on_train_end(self, args, state, control, **kwargs):
        plan = self.plan_of() if self.plan_of else None
        if not self._times or plan is None:
            return
        median = statistics.median(self._times)
        tokens = self.tokens_per_step()
        if not tokens:  # the batch shape is unknown: a tokens/s figure would be made up
            return
        step = predicted_step_seconds(plan.predictions, args.gradient_accumulation_steps)
        self.report = ThroughputReport(
            measured_tokens_per_s=tokens / median,
            predicted_tokens_per_s=tokens / step if step else None,
            median_step_s=median, steps=len(self._times), warmup_s=self._warmup)
        if state.is_world_process_zero:
            print(self.report.line(), flush=True)
            report = self.time_report_of() if self.time_report_of else None
            if report is not None:
                print(format_report(report), flush=True)
