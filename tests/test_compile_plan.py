"""``hf-elixir plan --compile`` prices a compiled run (issue 64, build item 2).

The hardware figures have no compiled factor, so the plan assumes one
(``planner/efficiency.py`` ``COMPILED_COMPUTE_FACTOR``) and says it is an estimate. The plan's
predicted step must change with the option (its compute priced at the factor), the summary
and the plan JSON must report it, and ``--efficiency measure`` (which would time the eager
model and call it compiled) must be refused before anything is planned.
"""

from __future__ import annotations

import pytest

from hf_elixir.cli import main
from hf_elixir.planner.efficiency import COMPILED_COMPUTE_FACTOR
from hf_elixir.planner.record import ElixirPlan

ARGS = ["--hardware", "a100-40g", "--batch-size", "2", "--seq-len", "64"]


@pytest.fixture()
def config_json(tmp_path):
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=128, bos_token_id=0, eos_token_id=0)
    path = tmp_path / "tiny-gpt2.json"
    path.write_text(cfg.to_json_string())
    return str(path)


def _plan(config_json, tmp_path, capsys, *extra: str) -> tuple[ElixirPlan, str]:
    out = tmp_path / f"plan{len(list(tmp_path.glob('plan*.json')))}.json"
    assert main(["plan", config_json, *ARGS, *extra, "--json", str(out)]) == 0
    return ElixirPlan.from_json(out), capsys.readouterr().out


@pytest.mark.parametrize("efficiency", ["calibrated", "0.5"])
def test_compile_changes_the_predicted_step_and_says_it_is_an_estimate(config_json, tmp_path, capsys, efficiency):
    eager, eager_text = _plan(config_json, tmp_path, capsys, "--efficiency", efficiency)
    compiled, text = _plan(config_json, tmp_path, capsys, "--efficiency", efficiency, "--compile")
    assert "compile" not in eager.predictions and "compiled" not in eager_text
    e, c = eager.predictions, compiled.predictions
    # the same plan, its compute priced at the assumed factor of the eager efficiency
    assert c["compile"]["source"] == "estimate" and c["compile"]["factor"] == COMPILED_COMPUTE_FACTOR < 1
    assert c["compile"]["eager"] == pytest.approx(e["compute_efficiency"]["used"])
    assert c["compute_efficiency"]["used"] == pytest.approx(e["compute_efficiency"]["used"] * COMPILED_COMPUTE_FACTOR)
    assert c["step_time_s"] < e["step_time_s"]
    # (to 1%: the runtime's own copies inside compute are not priced at the efficiency)
    assert c["time"]["compute"] == pytest.approx(e["time"]["compute"] * COMPILED_COMPUTE_FACTOR, rel=0.01)
    assert "compiled (--compile)" in text and "an estimate" in text and f"{COMPILED_COMPUTE_FACTOR:.2f}x" in text


def test_compile_refuses_measure_before_planning(config_json, capsys):
    rc = main(["plan", config_json, *ARGS, "--efficiency", "measure", "--compile"])
    err = capsys.readouterr().err
    assert rc != 0 and "--compile with --efficiency measure" in err and "--efficiency calibrated" in err
