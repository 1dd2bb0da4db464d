"""``benchmarks/bench_step.py --compile --quick`` (issue 64, acceptance 4): hf_elixir
compiled beside plain DDP compiled and FSDP2 compiled per block, and the eager DDP and
hf_elixir runs, at world size 2 on gloo. The quick mode is a check that it runs, not a
figure: every compiled system really compiled (dynamo's counters from its rank, no
recompile after the warm-up), every eager one did not, all trained alike (first losses
against plain DDP's), and the summary's compile block is the quotient of its rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from integration_helpers import ROOT, worker_env

COMPILED = ("ddp_compiled", "fsdp2_compiled", "hf_elixir_compiled")


def test_quick_compile_run_compiles_each_system_and_reports_the_ratios(tmp_path) -> None:
    out = tmp_path / "bench_step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--compile", "--quick",
                           "--output", str(out)], cwd=ROOT / "benchmarks", env=worker_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["config"]["quick"] and data["config"]["compile"] and data["config"]["world_size"] == 2
    rows = data["summary"]["gpt2-30m"]
    assert set(rows) == {"ddp", "ddp_compiled", "hf_elixir", "hf_elixir_compiled", "fsdp2_compiled", "compile"}
    for name, row in rows.items():
        if name == "compile":
            continue
        counts = row["dynamo"]
        if name in COMPILED:
            assert counts["frames_ok"] > 0 and counts["unique_graphs"] >= 1 and counts["recompiles"] == 0, (name,
                                                                                                          counts)
        else:
            assert counts == {"frames_ok": 0, "unique_graphs": 0, "recompiles": 0}, (name, counts)
        assert row["losses_match"], (name, row["first_losses"], rows["ddp"]["first_losses"])
        assert row["median_step_s"] > 0
    c, step = rows["compile"], {k: r["median_step_s"] for k, r in rows.items() if k != "compile"}
    assert c["hf_elixir_compiled_over_ddp_compiled"] == pytest.approx(step["hf_elixir_compiled"] / step["ddp_compiled"])
    assert c["hf_elixir_compiled_over_fsdp2_compiled"] == pytest.approx(step["hf_elixir_compiled"]
                                                                        / step["fsdp2_compiled"])
    assert c["compile_gain_hf_elixir"] == pytest.approx(step["hf_elixir"] / step["hf_elixir_compiled"])
    assert c["compile_gain_ddp"] == pytest.approx(step["ddp"] / step["ddp_compiled"])
    assert c["compile_gain_fsdp2"] is None  # eager FSDP2 is left out of --quick
    assert c["gain_at_least_ddp"] == (c["compile_gain_hf_elixir"] >= c["compile_gain_ddp"])
    assert "compiled gpt2-30m: hf_elixir" in proc.stdout
