"""benchmarks/bench_host_step.py in its quick mode: both adds give the same bits, and the JSON
holds every figure, per compute dtype and thread count. Timings are not asserted (a benchmark's job)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_times_both_adds_and_every_host_step(tmp_path: Path) -> None:
    out = tmp_path / "bench_host_step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host_step.py"), "--quick",
                           "--threads", "1", "2", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["compute_dtype"], row["threads"]) for row in rows] == [
        ("bfloat16", 1), ("bfloat16", 2), ("float16", 1), ("float16", 2)]
    steps = {"plain", "clip_pass", "torch_kernel", "hf_elixir"}
    for row in rows:
        assert row["bit_equal"] is True and row["elements"] == 1 << 20
        for field, arms in (("add_ms", {"torch_mixed", "hf_elixir"}), ("host_step_elements_per_s", steps)):
            assert set(row[field]) == arms and min(row[field].values()) > 0
        assert row["add_speedup"] > 0 and row["host_step_speedup"] > 0 and row["clip_in_update_speedup"] > 0
        assert row["vs_torch_kernel"] > 0
