"""Trainer integration: an unmodified Trainer script under `hf-elixir launch` against plain
`accelerate launch` (DDP), checkpoints, and resuming at world size 2 and 1."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from harness import free_port
from hf_elixir.integrations.launch import accelerate_view, default_config, read_config, write_config
from hf_elixir.integrations.plugin import ElixirPlugin
from integration_helpers import (SCRIPTS, accelerate_launch, check, elixir_launch, max_diff, run, trainer_args,
                                 worker_env)

SCRIPT = "trainer_run.py"
# 48 samples, 2 per device, 2 processes, accumulation 2: 6 optimizer steps in one epoch
TRAIN_ARGS = trainer_args()


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer_configs")
    write_config(d / "elixir.yaml", default_config(2, use_gpu=False), ElixirPlugin(plan="auto"))
    plain, _ = accelerate_view(read_config(d / "elixir.yaml"), cuda=False)
    (d / "plain.yaml").write_text(yaml.safe_dump(plain))
    return d / "elixir.yaml", d / "plain.yaml"


@pytest.fixture(scope="module")
def runs(configs, tmp_path_factory):
    """The plain reference and the uninterrupted elixir run (with checkpoints at 3 and 6)."""
    d = tmp_path_factory.mktemp("trainer_runs")
    accelerate_launch(configs[1], free_port(), SCRIPT, "--output_dir", str(d / "plain"),
                      "--result", str(d / "plain.pt"), *TRAIN_ARGS, cwd=d)
    proc = elixir_launch(configs[0], free_port(), SCRIPT, "--output_dir", str(d / "elixir"),
                         "--result", str(d / "elixir.pt"), *TRAIN_ARGS, cwd=d)
    return d, torch.load(d / "plain.pt"), torch.load(d / "elixir.pt"), proc


def test_unmodified_trainer_script_equals_plain_run(runs) -> None:
    """Acceptance 2 (Trainer) and 3: accumulation, clipping, evaluation every 3 steps."""
    d, plain, elixir, proc = runs
    assert not plain["is_elixir"] and plain["trainer"] == "Trainer" and plain["world"] == 2
    assert elixir["is_elixir"] and elixir["trainer"] == "ElixirTrainer" and elixir["world"] == 2
    assert "hf_elixir is active on 2 process(es)" in proc.stdout
    assert elixir["global_step"] == plain["global_step"] == 6
    assert len(elixir["evals"]) == 2
    assert elixir["evals"] == pytest.approx(plain["evals"], rel=1e-5)
    assert max_diff(elixir["state"], plain["state"]) < 2e-5
    ckpt = d / "elixir" / "checkpoint-3"
    assert (ckpt / "elixir_state" / "elixir_index.json").is_file()  # sharded weights + optimizer
    assert (ckpt / "scheduler.pt").is_file() and (ckpt / "trainer_state.json").is_file()
    assert (ckpt / "rng_state_0.pth").is_file() and (ckpt / "model.safetensors").is_file()


def test_final_folder_loads_with_from_pretrained(runs) -> None:
    _, _, elixir, _ = runs
    model = AutoModelForCausalLM.from_pretrained(elixir["final"]).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16).reshape(1, 16) % 96).logits
    torch.testing.assert_close(logits, elixir["logits"], rtol=1e-5, atol=1e-5)
    reloaded = {k: v for k, v in model.state_dict().items()}
    assert max(abs(reloaded[k] - v).max().item() for k, v in elixir["state"].items() if k in reloaded) < 1e-6


def test_resume_at_world_size_2(configs, runs, tmp_path) -> None:
    """Acceptance 3: resume from step 3 at the same world size; same final weights."""
    d, _, elixir, _ = runs
    out = tmp_path / "resumed"
    shutil.copytree(d / "elixir" / "checkpoint-3", out / "checkpoint-3")
    elixir_launch(configs[0], free_port(), SCRIPT, "--output_dir", str(out), "--result", str(tmp_path / "r.pt"),
                  "--resume_from_checkpoint", str(out / "checkpoint-3"), *TRAIN_ARGS, cwd=tmp_path)
    resumed = torch.load(tmp_path / "r.pt")
    assert resumed["global_step"] == 6 and resumed["is_elixir"]
    assert max_diff(resumed["state"], elixir["state"]) < 2e-6


def test_resume_at_world_size_1(runs, tmp_path) -> None:
    """Acceptance 3: resume the 2-process checkpoint in one process (the same global batch:
    accumulation 4 instead of 2 x 2); the checkpoint reshards and training ends the same."""
    d, _, elixir, _ = runs
    out = tmp_path / "resumed"
    shutil.copytree(d / "elixir" / "checkpoint-3", out / "checkpoint-3")
    args = list(TRAIN_ARGS)
    acc = args.index("--gradient_accumulation_steps")
    args[acc + 1] = "4"
    check(run([sys.executable, "-m", "hf_elixir.integrations.bootstrap", str(SCRIPTS / SCRIPT),
               "--output_dir", str(out), "--result", str(tmp_path / "r.pt"),
               "--resume_from_checkpoint", str(out / "checkpoint-3"), *args],
              tmp_path, worker_env(ACCELERATE_USE_ELIXIR="true")))
    resumed = torch.load(tmp_path / "r.pt")
    assert resumed["world"] == 1 and resumed["is_elixir"] and resumed["global_step"] == 6
    assert max_diff(resumed["state"], elixir["state"]) < 2e-5
