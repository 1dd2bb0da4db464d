"""TRL's SFTTrainer compiled (issue 64, acceptance 3): the same unmodified SFT script with
``--torch_compile true`` under plain ``accelerate launch`` (DDP, the whole model compiled)
and under ``hf-elixir launch`` (each decoder layer compiled, under SFTConfig's default
gradient checkpointing and TRL's fused LM head reading a released weight). Logged losses and
grad norms agree, and the elixir run says what it compiled and warns of nothing."""

from __future__ import annotations

import pytest
import torch
import yaml

from harness import free_port
from hf_elixir.integrations.launch import accelerate_view, default_config, read_config, write_config
from hf_elixir.integrations.plugin import ElixirPlugin
from integration_helpers import accelerate_launch, elixir_launch
from test_trl import ELIXIR_OPTIONS, SCRIPT, SFT_ARGS


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl_compiled")
    write_config(d / "elixir.yaml", default_config(2, use_gpu=False), ElixirPlugin(**ELIXIR_OPTIONS))
    plain, _ = accelerate_view(read_config(d / "elixir.yaml"), cuda=False)
    (d / "plain.yaml").write_text(yaml.safe_dump(plain))
    args = ["--arch", "llama", "--lora", "false", "--torch_compile", "true", *SFT_ARGS]
    accelerate_launch(d / "plain.yaml", free_port(), SCRIPT, "--output_dir", str(d / "plain"),
                      "--result", str(d / "plain.pt"), *args, cwd=d)
    proc = elixir_launch(d / "elixir.yaml", free_port(), SCRIPT, "--output_dir", str(d / "elixir"),
                         "--result", str(d / "elixir.pt"), *args, cwd=d)
    load = lambda name: torch.load(d / name, weights_only=False)  # noqa: E731
    return load("plain.pt"), load("elixir.pt"), proc


def test_compiled_sft_under_launch_matches_compiled_ddp(runs) -> None:
    plain, elixir, proc = runs
    assert plain["wrapped"] == "OptimizedModule" and not plain["is_elixir"]
    assert elixir["is_elixir"] and elixir["wrapped"] == "ElixirModule"
    assert "compile: 2 block(s) (LlamaDecoderLayer)" in proc.stdout and "CompileWarning" not in proc.stderr
    steps = lambda run: [h for h in run["log_history"] if "loss" in h]  # noqa: E731
    assert len(steps(plain)) == len(steps(elixir)) == 3
    for p, e in zip(steps(plain), steps(elixir)):
        for key in ("loss", "grad_norm"):
            assert e[key] == pytest.approx(p[key], rel=1e-5), (p["step"], key, p[key], e[key])
