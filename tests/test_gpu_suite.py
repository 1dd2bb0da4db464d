"""Acceptance 2 of issue 10: ``benchmarks/gpu_suite.sh --dry-run`` runs every step of the
GPU suite on the CPU (tiny models, every system, the JSON written), so the script is known
to work before a GPU is lent. Its output goes to a temporary file: the committed results
stay untouched."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "benchmarks" / "results" / "gpu_suite.json"


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_gpu_suite_dry_run_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    before = _digest(COMMITTED)
    env = {k: v for k, v in os.environ.items() if k != "HF_ELIXIR_COLLECTIVES"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert _digest(COMMITTED) == before, "a dry run must not overwrite the committed results"
    data = json.loads(out.read_text())
    assert data["mode"].startswith("dry-run")
    # a dry run starts its jobs two at a time (GPU runs one); the file keeps the sections' order
    assert data["settings"]["lanes"] == 2
    sections = ["smoke", "offload_24g", "trainer", "scale", "mfu", "recovery", "disk_tier", "trainer_compiled",
                "fidelity"]
    assert [k for k in data if k in sections] == sections

    smoke = data["smoke"]
    assert smoke["status"] == "ok" and not smoke["direct"]["failures"]
    assert smoke["direct"]["checked"] and smoke["torchrun"]["backend"] == "gloo"

    deepspeed = importlib.util.find_spec("deepspeed") is not None
    runs = {**{f"offload_24g/{k}": v for k, v in data["offload_24g"].items()},
            **{f"mfu/{k}": v for k, v in data["mfu"].items()}}
    assert set(runs) == {"offload_24g/hf_elixir", "offload_24g/fsdp2_offload", "offload_24g/deepspeed_offload",
                         "mfu/hf_elixir", "mfu/fsdp2"}
    for name, r in runs.items():
        if name.endswith("deepspeed_offload") and not deepspeed:
            assert r["status"] == "unavailable"
            continue
        assert r["status"] == "ok", f"{name}: {r.get('error')}\n{r.get('traceback', '')}"
        assert r["tokens_per_s"] > 0 and len(r["step_times_s"]) == 3 and r["finite"], name
    assert "predicted_peak_bytes" in data["offload_24g"]["hf_elixir"]["plan"]
    assert all(0 < r["mfu"]["mfu"] for r in data["mfu"].values())

    scale = data["scale"]
    assert [t["status"] for t in scale["tried"]] == ["ok", "ok"] and scale["largest"] == scale["tried"][-1]["model"]
    # issue 36, build item 6: a batch that does not fit runs as the planner's largest
    # micro-batch that does (the first model's budget is about a quarter of its unsplit peak)
    split, whole = scale["tried"][0]["plan"], scale["tried"][1]["plan"]
    assert split["micro_batch_split"] > 1 and whole["micro_batch_split"] == 1, (split["summary"], whole["summary"])
    assert scale["tried"][0]["time_report"]["measured"]["micro_batches"] == split["micro_batch_split"]
    assert "micro-batches" in proc.stdout
    rows = data["fidelity"]
    assert {r["section"] for r in rows} == {"offload_24g", "scale"} and len(rows) == 3
    assert all(r["step_ratio"] > 0 for r in rows)
    # on a CPU the measured peak is the runtime's device bytes: none where the plan put every
    # chunk on the host (the budgeted model), so its ratio is 0 there, not a GPU figure
    on_device = [r for r in rows if r["measured_peak_bytes"]]
    assert len(on_device) >= 2 and all(r["peak_ratio"] > 0 for r in on_device)

    recovery = data["recovery"]  # on a CPU the squeeze is an injected out-of-memory error
    assert recovery["status"] == "ok", f"{recovery.get('error')}\n{recovery.get('traceback', '')}"
    assert len(recovery["events"]) == 1 and recovery["events"][0]["change"]
    assert len(recovery["step_times_s"]) == 6 and recovery["tokens_per_s_after"] > 0
    # squeezed cap by cap until a step fails: here the first, where the error is injected
    assert [(q["fraction_of_peak"], q["failures"]) for q in recovery["squeezes"]] == [(0.8, 1)]
    assert "caps 80% of the peak" in proc.stdout
    assert "recovery" in proc.stdout

    # issue 38: the disk tier against the host tier (bench_disk_tier.py --quick on the CPU)
    disk = data["disk_tier"]
    assert disk["status"] == "ok", f"{disk.get('error')}\n{disk.get('stderr', '')}\n{disk.get('traceback', '')}"
    assert disk["device"] == "cpu" and disk["config"]["quick"] and disk["config"]["device"] == "cpu"
    assert disk["disk"]["read_MBps"] > 0 and disk["disk"]["write_MBps"] > 0
    assert disk["disk_chunks"] > 0 and disk["read_bytes_per_step"] > 0 and disk["written_bytes_per_step"] > 0
    assert disk["step_ratio_disk_to_host"] > 0 and disk["io_efficiency"] > 0
    assert disk["weights_match_host"] is True and disk["losses_match_host"] is True
    assert disk["files_left"] == [] and 0 < disk["wall_s"]
    assert "disk_tier" in proc.stdout and "step disk/host" in proc.stdout
    assert not list(tmp_path.glob(".gpu_suite_disk_tier_*")), "the section's scratch directory must go"

    # each hf_elixir run's step breakdown, measured beside predicted, in the JSON and printed
    for name, r in (("offload_24g", data["offload_24g"]["hf_elixir"]), ("mfu", data["mfu"]["hf_elixir"])):
        report = r["time_report"]
        assert report["steps"] >= 2 and report["measured"]["step"] > 0, name
        assert report["predicted"]["step"] > 0 and set(report["predicted"]) - {"collectives"} <= set(report["measured"]), name
        assert f"breakdown {name} {r['model']}:" in proc.stdout
    # issue 36, acceptance 4's third point: a stock Trainer script, plain and under hf-elixir launch
    trainer = data["trainer"]
    assert set(trainer) == {"plain", "hf_elixir_offload_none"}
    plain, elixir = trainer["plain"], trainer["hf_elixir_offload_none"]
    for name, r in trainer.items():
        assert r["status"] == "ok", f"{name}: {r.get('error')}\n{r.get('stderr', '')}"
        assert r["world"] == 1 and r["bf16"] and r["tokens_per_s"] > 0 and len(r["step_times_s"]) == 5, name
    assert plain["trainer"] == "Trainer" and plain["time_report"] is None
    assert elixir["trainer"] == "ElixirTrainer" and elixir["offload"] == "none"
    assert elixir["vs_plain"] == elixir["tokens_per_s"] / plain["tokens_per_s"]
    assert elixir["time_report"]["measured"]["step"] > 0
    assert "the plain Trainer" in proc.stdout and "breakdown trainer gpt2-tiny:" in proc.stdout
    assert not plain["torch_compile"] and plain["dynamo"]["frames_ok"] == 0
    assert not elixir["torch_compile"] and elixir["dynamo"]["frames_ok"] == 0

    # issue 64, acceptance 5: the same script compiled (--torch_compile true), plain and under
    # hf-elixir launch; dynamo's counters show that both really compiled
    compiled = data["trainer_compiled"]
    assert set(compiled) == {"plain", "hf_elixir_offload_none"}
    c_plain, c_elixir = compiled["plain"], compiled["hf_elixir_offload_none"]
    for name, r in compiled.items():
        assert r["status"] == "ok", f"compiled {name}: {r.get('error')}\n{r.get('stderr', '')}"
        assert r["world"] == 1 and r["bf16"] and r["tokens_per_s"] > 0 and len(r["step_times_s"]) == 5, name
        assert r["torch_compile"] and r["dynamo"]["frames_ok"] > 0 and r["dynamo"]["unique_graphs"] > 0, (name, r)
    assert c_plain["trainer"] == "Trainer" and c_elixir["trainer"] == "ElixirTrainer"
    assert c_elixir["vs_plain"] == c_elixir["tokens_per_s"] / c_plain["tokens_per_s"]
    assert c_elixir["target_vs_plain"] == 0.95 and "meets_target" not in c_elixir  # a CPU measures nothing
    assert c_elixir["time_report"]["measured"]["step"] > 0
    assert "breakdown trainer_compiled gpt2-tiny:" in proc.stdout and "(target 0.95x)" in proc.stdout
    assert proc.stdout.count("step time by phase (mean of") == 4 + len(scale["tried"])

    # issue 61, point 5: a LoRA fine-tune at the longest sequence its plan allows, trained with
    # that plan; on a CPU with no cap the one probe fits, and the peak is the runtime's ledger
    long = data["long_context"]
    assert long["status"] == "ok", f"{long.get('error')}\n{long.get('traceback', '')}"
    wanted = data["settings"]["long_context"]
    assert long["seq_len"] == long["plan"]["seq_len"] == wanted["limit"] and long["probes"][-1]["fits"]
    assert len(long["step_times_s"]) == wanted["steps"] and len(long["losses"]) == wanted["warmup"] + wanted["steps"]
    assert long["finite"] and long["measured_peak_bytes"] > 0 and long["plan"]["predicted_peak_bytes"] > 0
    assert long["peak_ratio"] == long["measured_peak_bytes"] / long["plan"]["predicted_peak_bytes"]
    assert long["step_ratio"] > 0 and long["peak_source"] == "memory_report() peak_total"
    assert "long_ctx" in proc.stdout and f"{wanted['limit']} tokens" in proc.stdout
