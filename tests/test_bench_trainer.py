"""benchmarks/bench_trainer.py in its ``--quick`` mode: both commands run as a user runs them
(the launched one really trains with hf_elixir's Trainer, the plain one with the stock one),
and the ratio it reports is the one their own timings give."""

from __future__ import annotations

import json
import sys

from integration_helpers import benchmark_module


def test_quick_run_times_the_plain_and_the_launched_trainer(tmp_path, monkeypatch) -> None:
    bench = benchmark_module("bench_trainer")
    out = tmp_path / "trainer.json"
    monkeypatch.setattr(sys, "argv", ["bench_trainer.py", "--quick", "--dtypes", "fp32", "--out", str(out)])
    bench.main()
    data = json.loads(out.read_text())
    (run,) = data["dtypes"]["fp32"]["rounds"]
    assert run["trainers"] == {"plain": "Trainer", "hf_elixir": "ElixirTrainer"}
    assert run["vs_plain"] == run["tokens_per_s"]["hf_elixir"] / run["tokens_per_s"]["plain"] > 0
    assert data["dtypes"]["fp32"]["median_vs_plain"] == run["vs_plain"]
    breakdown = run["hf_elixir_breakdown"]
    assert breakdown["steps"] > 0 and breakdown["measured"]["forward_backward"] > 0
