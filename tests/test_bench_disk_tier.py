"""benchmarks/bench_disk_tier.py end to end in its ``--quick`` mode (a tiny model, a few
steps): the script runs in a subprocess as a user runs it, writes the JSON that
docs/benchmarks.md describes, and its disk-tier system trains to the host tier's weights and
losses bit for bit (the tier only moves state; it must never change it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_writes_its_figures_and_the_disk_tier_equals_the_host_tier(tmp_path) -> None:
    out, nvme = tmp_path / "bench.json", tmp_path / "nvme"
    nvme.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_disk_tier.py"), "--quick",
                          "--systems", "disk_half", "host", "--path", str(nvme), "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "disk tier equals host tier: weights True, losses True" in run.stdout
    data = json.loads(out.read_text())

    disk = data["disk"]
    for key in ("read_bytes_per_s", "write_bytes_per_s"):
        assert disk[key] > 0 and disk["before"][key] > 0 and disk["after"][key] > 0
    assert disk["before"]["block_bytes"] % 4096 == 0 and disk["before"]["path"] == str(nvme.resolve())
    assert data["config"]["quick"] and data["config"]["parameters"] > 0 and data["config"]["steps"] >= 2
    assert len(data["machine"]["load_before"]) == 3

    rows = data["systems"]
    assert set(rows) == {"disk_half", "host"}
    host, half = rows["host"], rows["disk_half"]
    assert host["disk_chunks"] == 0 and half["disk_chunks"] * 2 in (half["n_chunks"], half["n_chunks"] - 1)
    assert half["disk_chunks"] > 3  # more disk chunks than the ring's buffers: state went to the file and back
    # the tier moves state, never changes it
    assert half["weights_match_host"] and half["losses_match_host"]
    assert half["weights_sha256"] == host["weights_sha256"] and half["losses"] == host["losses"]
    for row in rows.values():
        assert row["median_step_s"] > 0 and len(row["step_s"]) == data["config"]["steps"]
        assert row["step_ratio_to_host"] > 0
    assert host["step_ratio_to_host"] == 1.0

    traffic = half["traffic"]
    # every step reads and writes back each disk chunk's Adam moments: at least the state's bytes each way
    assert traffic["read_bytes_per_step"] >= half["disk_state_bytes"] * 0.99
    assert traffic["written_bytes_per_step"] >= half["disk_state_bytes"] * 0.99
    assert half["io"]["busy_seconds"] > 0
    for key in ("io_efficiency", "read_efficiency", "write_efficiency", "wall_efficiency", "achieved_bytes_per_s"):
        assert traffic[key] > 0, key
    assert data["files_left"] == []  # the tier's scratch directory went at the ranks' exit
