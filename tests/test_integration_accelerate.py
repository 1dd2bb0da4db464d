"""Accelerate integration: ElixirAccelerator and `hf-elixir launch` against plain Accelerate.

Real processes: `accelerate launch` (DDP over gloo on MULTI_CPU) is the reference; the same
script runs with ElixirAccelerator and, unmodified, under `hf-elixir launch`.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from harness import free_port
from hf_elixir.integrations.launch import accelerate_view, read_config
from hf_elixir.runtime.host_memory import rank_environment
from integration_helpers import accelerate_launch, check, elixir_launch, hf_elixir, max_diff

SCRIPT = "accelerate_loop.py"


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """The config `hf-elixir config --non-interactive` writes, and the same without its
    elixir: section (what plain `accelerate launch` is given)."""
    d = tmp_path_factory.mktemp("configs")
    check(hf_elixir("config", "--non-interactive", "--num_processes", "2", "--use_cpu",
                    "--config_file", str(d / "elixir.yaml"), cwd=d))
    data = yaml.safe_load((d / "elixir.yaml").read_text())
    assert data["elixir"]["plan"] == "auto" and data["num_processes"] == 2
    # Accelerate's own loader rejects the elixir: section and accepts the rest
    with pytest.raises(Exception, match="elixir"):
        load_config_from_file(str(d / "elixir.yaml"))
    del data["elixir"]
    (d / "stripped.yaml").write_text(yaml.safe_dump(data))
    assert load_config_from_file(str(d / "stripped.yaml")).num_processes == 2
    # On CPU, Accelerate starts several processes only through MPI; the plain reference gets
    # the same torchrun-based form the elixir launcher hands Accelerate
    plain, env = accelerate_view(read_config(d / "elixir.yaml"), cuda=False)
    # and CPU ranks start with glibc's per-thread cache off (runtime/host_memory.py)
    assert env == {"ACCELERATE_USE_CPU": "true", "GLIBC_TUNABLES": rank_environment()["GLIBC_TUNABLES"]}
    assert "glibc.malloc.tcache_count=0" in env["GLIBC_TUNABLES"]
    (d / "plain.yaml").write_text(yaml.safe_dump(plain))
    return d / "elixir.yaml", d / "plain.yaml"


@pytest.fixture(scope="module")
def plain_result(configs, tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    accelerate_launch(configs[1], free_port(), SCRIPT, "--out", str(d / "r.pt"), cwd=d)
    result = torch.load(d / "r.pt")
    assert result["type"] == "Accelerator" and not result["is_elixir"] and result["world"] == 2
    assert result["distributed_type"] == "DistributedType.MULTI_CPU"
    return result


def assert_same_training(result: dict, reference: dict) -> None:
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert result["norms"] == pytest.approx(reference["norms"], rel=1e-4)
    assert max_diff(result["state"], reference["state"]) < 2e-5


def test_elixir_accelerator_equals_plain_accelerator(configs, plain_result, tmp_path) -> None:
    """Acceptance 1: the same custom loop (accumulation 2, clipping) with ElixirAccelerator."""
    proc = accelerate_launch(configs[1], free_port(), SCRIPT, "--out", str(tmp_path / "r.pt"), "--elixir",
                             cwd=tmp_path)
    result = torch.load(tmp_path / "r.pt")
    assert result["type"] == "ElixirAccelerator" and result["is_elixir"]
    assert result["distributed_type"] == "DistributedType.MULTI_CPU"  # Accelerate's own type is kept
    assert "hf_elixir is active on 2 process(es)" in proc.stdout
    assert_same_training(result, plain_result)


def test_launch_gives_unmodified_accelerate_script_the_runtime(configs, plain_result, tmp_path) -> None:
    """Acceptance 2 (Accelerate) and 4: the generated config launches; the plain script's
    `from accelerate import Accelerator` becomes an active ElixirAccelerator."""
    proc = elixir_launch(configs[0], free_port(), SCRIPT, "--out", str(tmp_path / "r.pt"), cwd=tmp_path)
    result = torch.load(tmp_path / "r.pt")
    assert result["is_elixir"] and result["type"] == "ElixirAccelerator"
    assert proc.stdout.count("hf_elixir is active") == 1  # main process only
    assert "Elixir plan for GPT2LMHeadModel" in proc.stdout
    assert_same_training(result, plain_result)


def test_save_state_and_load_state_reshard(configs, tmp_path) -> None:
    """save_state at world size 2 writes the sharded state plus Accelerate's files;
    load_state in one process (another world size) restores the same weights."""
    state = tmp_path / "state"
    elixir_launch(configs[0], free_port(), SCRIPT, "--out", str(tmp_path / "a.pt"), "--steps", "2",
                  "--save_state", str(state), cwd=tmp_path)
    assert (state / "elixir_state" / "elixir_index.json").is_file()
    assert (state / "scheduler.bin").is_file() and any(state.glob("random_states_*.pkl"))
    assert not (state / "model.safetensors").exists()  # the weights live in the sharded state only
    import sys

    from integration_helpers import SCRIPTS, run, worker_env

    check(run([sys.executable, "-m", "hf_elixir.integrations.bootstrap", str(SCRIPTS / SCRIPT),
               "--out", str(tmp_path / "b.pt"), "--steps", "0", "--load_state", str(state)],
              tmp_path, worker_env(ACCELERATE_USE_ELIXIR="true")))
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert b["is_elixir"] and b["world"] == 1
    assert max_diff(a["state"], b["state"]) == 0.0
