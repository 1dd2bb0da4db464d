"""benchmarks/bench_lora.py in its quick mode (two-block GPT-2 and Llama stand-ins, a few
steps): every system trains from the same weights and batches, and the JSON holds the
figures the issue asks for. Timings are not asserted (meaningless on tiny models); the
frozen-byte figures are checked against what each system must hold at least."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = {"ddp", "fsdp2", "hf_elixir", "hf_elixir_min"}


def _quick_run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench_lora.json"
    env = {k: v for k, v in os.environ.items() if k != "HF_ELIXIR_COLLECTIVES"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lora.py"), "--quick", "--output", str(out),
                           *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").exists() or "matplotlib not installed" in proc.stdout
    assert data["lora"]["r"] == 16 and data["config"]["world_size"] == 2
    return data


def test_quick_run_trains_every_system(tmp_path: Path) -> None:
    data = _quick_run(tmp_path)
    assert set(data["summary"]) == {"gpt2-tiny", "llama-tiny"} and data["qlora"] is None
    _check(data)


def test_quick_qlora_run_trains_every_system_on_the_packed_base(tmp_path: Path) -> None:
    """--qlora: the same figures with the base in 4 bits; every system holds the packed
    base (DDP whole, the sharded ones half), not its float weights."""
    data = _quick_run(tmp_path, "--qlora")
    assert set(data["summary"]) == {"llama-tiny"} and data["qlora"]["quant_type"] == "nf4"
    # packed blocks are an eighth of their fp32 bytes, so the root's fp32 embedding and head
    # are most of this base; FSDP2 keeps them gathered from forward into backward beside a
    # block and the next one it prefetches: a little over the whole base at once
    _check(data, gathered_bound=1.1)
    rows = data["summary"]["llama-tiny"]
    # the projections at half a byte a weight, the embeddings, head and norms in fp32
    config = _tiny_llama()
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    weights = n * (2 * h * h + 2 * h * kv + 3 * h * i)
    floats = 4 * (2 * config.vocab_size * h + (2 * n + 1) * h)
    assert rows["ddp"]["frozen"]["base_bytes"] == weights // 2 + floats
    assert rows["hf_elixir"]["plan"]["frozen_chunks"] > 0


def _tiny_llama():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_lora import tiny_config
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return tiny_config("llama-tiny")


def _check(data: dict, gathered_bound: float = 1.0) -> None:
    """The figures every mode must have; a sharded system gathers at most
    ``gathered_bound`` times the whole base at once."""
    summary = data["summary"]
    for model, rows in summary.items():
        assert set(rows) == SYSTEMS, model
        raw = data["raw"][model]
        start = rows["ddp"]["first_losses"][0]
        base = rows["ddp"]["frozen"]["base_bytes"]
        for system, row in rows.items():
            where = f"{model}/{system}"
            losses = raw[system]["losses"]
            assert len(losses) == data["config"]["warmup"] + data["config"]["steps"], where
            assert row["losses_finite"] and all(math.isfinite(x) for x in losses), where
            # same weights, same batch: the same first loss
            assert abs(row["first_losses"][0] - start) <= 1e-4 * abs(start), (where, row["first_losses"], start)
            assert row["losses_match"], where
            assert row["median_step_s"] > 0 and row["tokens_per_s"] > 0, where
            assert row["ratio_to_ddp"] > 0 and row["ratio_to_fsdp2"] > 0, where
            assert row["trainable_params"] == rows["ddp"]["trainable_params"], where
            assert row["bytes_per_step"]["total"] > 0, where

            f = row["frozen"]
            assert f["base_bytes"] == base, where
            assert f["per_rank_peak_bytes"] == f["resident_bytes"] + f["gathered_peak_bytes"], where
            assert f["share_of_base"] == pytest.approx(f["per_rank_peak_bytes"] / base), where
        # DDP replicates the base; the sharded systems keep half of it (plus padding) and
        # gather some of it during a step
        assert rows["ddp"]["frozen"]["resident_bytes"] == base
        assert rows["ddp"]["frozen"]["gathered_peak_bytes"] == 0
        for system in ("fsdp2", "hf_elixir", "hf_elixir_min"):
            f = rows[system]["frozen"]
            assert base / 2 <= f["resident_bytes"] <= base / 2 * 1.05, (model, system, f)
            assert 0 < f["gathered_peak_bytes"] <= gathered_bound * base, (model, system, f)
        # hf_elixir's own ledger agrees on the shards it keeps on the device
        for system in ("hf_elixir", "hf_elixir_min"):
            f, report = rows[system]["frozen"], rows[system]["memory_report_peak"]
            assert report["frozen_shards"] == f["on_device_bytes"]
            assert f["on_device_bytes"] + f["offloaded_bytes"] == f["resident_bytes"]
            assert rows[system]["plan"]["frozen_chunks"] > 0
        # the smallest plan gathers less of the base at once than the roomy one
        lean, roomy = rows["hf_elixir_min"]["frozen"], rows["hf_elixir"]["frozen"]
        assert lean["gathered_peak_bytes"] < roomy["gathered_peak_bytes"]
