"""``hf-elixir plan`` and ``hf-elixir calibrate`` (acceptance 6)."""

from __future__ import annotations

import json

import pytest

from hf_elixir.cli import main
from hf_elixir.planner.record import ElixirPlan


@pytest.fixture()
def config_json(tmp_path):
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=128)
    path = tmp_path / "tiny-gpt2.json"
    path.write_text(cfg.to_json_string())
    return str(path)


def test_plan_prints_table_writes_json_and_png(config_json, tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", config_json, "--hardware", "a100-40g", "--gpus", "2", "--gpu-memory", "24GiB",
               "--batch-size", "2", "--seq-len", "64", "--dtype", "bf16", "--json", str(out_json),
               "--plot", str(out_png)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "chosen" in text and "memory per device" in text and "step time" in text
    p = ElixirPlan.from_json(out_json)
    assert p.world_size == 2 and p.compute_dtype == "bfloat16"
    assert p.to_dict() == json.loads(out_json.read_text())
    assert p.predictions["budget_bytes"] == 24 * 2**30
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 5000


def test_plan_reads_a_model_folder(config_json, tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(open(config_json).read())
    assert main(["plan", str(folder), "--hardware", "t4", "--seq-len", "32"]) == 0
    assert "chosen" in capsys.readouterr().out


def test_infeasible_plan_exits_nonzero_with_explanation(capsys):
    rc = main(["plan", "llama-2-7b", "--hardware", "a100-80g", "--gpu-memory", "512MiB", "--seq-len", "512"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "no plan fits" in err and "needs at least" in err and "GiB per device" in err


def test_plan_blocked_by_cpu_memory_exits_nonzero_and_says_so(capsys):
    """On a T4 node (64 GB of host memory) a 7B model fits 4 GiB of device memory only by
    offloading ~120 GiB of state to the host, which does not hold it."""
    rc = main(["plan", "llama-2-7b", "--hardware", "t4", "--gpu-memory", "4GiB", "--seq-len", "512"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "no plan fits" in err and "of CPU memory per node" in err and "more CPU memory" in err


@pytest.mark.parametrize("args,needle", [
    (["--hardware", "quantum-9000"], "unknown hardware preset"),
    (["--gpu-memory", "lots"], "cannot read memory size"),
    (["--gpus", "0"], "--gpus"),
])
def test_bad_arguments_get_a_clear_error(config_json, args, needle, capsys):
    rc = main(["plan", config_json, *args])
    assert rc == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("mem", ["24 GB", "24GiB", "24000MB"])
def test_memory_spellings_are_accepted(config_json, mem, capsys):
    assert main(["plan", config_json, "--hardware", "l4", "--gpu-memory", mem, "--seq-len", "32"]) == 0


def test_unknown_model_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["plan", str(bad)]) == 2
    assert "cannot read config JSON" in capsys.readouterr().err


def test_calibrate_prints_and_caches(tmp_path, capsys):
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--quick", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "CPU AdamW" in text and str(out) in text
    from hf_elixir.hardware import HardwareProfile

    assert HardwareProfile.from_json(out).sources["matmul_flops"] == "measured"
