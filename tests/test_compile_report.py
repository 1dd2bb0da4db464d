"""time_report() on one footing (issue 64, point 2): a measured step of N micro-batches
stands beside a prediction for N micro-batches, not for one; the first step (trace,
compile) is reported apart from the steady step, in the report and the throughput line."""

from __future__ import annotations

import pytest

from hf_elixir.integrations.throughput import ThroughputReport, predicted_step_seconds
from hf_elixir.runtime.timing import PHASES, format_report, summarize

#: the plan's figures for one step of one micro-batch (seconds)
PREDICTED = {"forward_backward": 0.040, "compute": 0.030, "exposed_communication": 0.010, "collectives": 0.02,
             "device_optimizer": 0.005, "cpu_optimizer": 0.0, "step": 0.050}


def measured_step(seconds: float, micro_batches: int) -> dict[str, float]:
    step = {phase: 0.0 for phase in PHASES}
    step.update(forward_backward=seconds - 0.005, compute=seconds - 0.015, exposed_communication=0.010,
                device_optimizer=0.005, step=seconds, micro_batches=float(micro_batches))
    return step


def test_prediction_is_for_the_measured_micro_batches() -> None:
    steps = [measured_step(0.900, 2)] + [measured_step(0.095, 2) for _ in range(4)]
    report = summarize(steps, PREDICTED)
    predicted = report["predicted"]
    # the passes run twice, the optimizer once: 2 x 40 ms + 10 ms
    assert predicted["forward_backward"] == pytest.approx(0.080)
    assert predicted["compute"] == pytest.approx(0.060)
    assert predicted["exposed_communication"] == pytest.approx(0.020)
    assert predicted["device_optimizer"] == pytest.approx(0.005)
    assert predicted["step"] == pytest.approx(0.090)
    assert report["predicted_one_micro_batch"] == PREDICTED
    # the same footing as the throughput line's prediction
    assert predicted["step"] == pytest.approx(predicted_step_seconds({"step_time_s": 0.050, "time": PREDICTED}, 2))
    text = format_report(report)
    assert "2 micro-batch(es) each), predicted for as many" in text.splitlines()[0]
    row = next(line for line in text.splitlines()[1:] if line.split()[:1] == ["step"])
    measured_ms, predicted_ms = (float(x) for x in row.split()[1:3])
    assert measured_ms == pytest.approx(95.0) and predicted_ms == pytest.approx(90.0)


def test_one_micro_batch_keeps_the_plans_figures() -> None:
    report = summarize([measured_step(0.06, 1) for _ in range(3)], PREDICTED)
    assert report["predicted"] == PREDICTED


def test_the_first_step_is_reported_apart() -> None:
    steps = [measured_step(0.900, 1)] + [measured_step(0.100, 1) for _ in range(3)]
    report = summarize(steps, PREDICTED)
    assert report["first_step"] == pytest.approx(0.900) and report["warmup"] == pytest.approx(0.800)
    assert report["measured"]["step"] == pytest.approx(0.100)
    assert "the first step, left out, took 900.00 ms, 800.00 ms above the steady step" in format_report(report)
    line = ThroughputReport(measured_tokens_per_s=1000.0, predicted_tokens_per_s=None, median_step_s=0.1,
                            steps=8, warmup_s=2.5).line()
    assert "took 2.50 s (+2.30 s beyond steady steps" in line
