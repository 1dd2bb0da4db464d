"""benchmarks/bench_resident.py in its ``--quick`` mode, in this process: it writes the JSON
docs/benchmarks.md describes, times both systems by phase, and the two trained alike (the
script refuses to report a ratio between runs whose losses parted)."""

from __future__ import annotations

import json
import sys

from integration_helpers import benchmark_module


def test_quick_run_times_both_systems_by_phase(tmp_path, monkeypatch) -> None:
    bench = benchmark_module("bench_resident")
    out = tmp_path / "resident.json"
    monkeypatch.setattr(sys, "argv", ["bench_resident.py", "--quick", "--out", str(out)])
    bench.main()
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["model"] == "gpt2-deep" and row["steps"] == 3 and row["parameters"] > 0
    assert row["max_loss_difference"] <= 1e-5
    for system in ("plain", "hf_elixir"):
        phases = [row[system][phase] for phase in bench.PHASES]
        assert all(t > 0 for t in phases), (system, phases)
        assert row[system]["step_s"] > 0
    assert row["ratio"] == row["hf_elixir"]["step_s"] / row["plain"]["step_s"]
    assert data["machine"]["threads"] >= 1
