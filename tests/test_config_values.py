"""Config values that used to crash late, or mean something nobody meant (issue 60, finding 7).

Each is refused where it is read (the config file, the environment, the command line, the
planner's arguments), with a message that names the option and says what to write, before
anything starts: YAML's ``.nan`` and ``.inf`` as a memory size or a number, sizes below one
byte, and a memory size without a unit small enough to be a unit left out
(``gpu_memory: 24``). Byte counts a program passes (``memory_budget=24 * 2**30``) keep working.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_elixir.cli import main
from hf_elixir.hardware import HardwareError, parse_memory
from hf_elixir.integrations.launch import LaunchError, read_config
from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin
from hf_elixir.planner import search
from hf_elixir.planner.record import PlanError
from hf_elixir.vocab import parse_bytes


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in [k for k in os.environ if k.startswith("ELIXIR_") or k == "ACCELERATE_USE_ELIXIR"]:
        monkeypatch.delenv(key)


def _yaml(tmp_path, section: str):
    path = tmp_path / "elixir.yaml"
    path.write_text(f"distributed_type: NO\nnum_processes: 1\nelixir:\n  {section}\n")
    return path


# ---------------------------------------------------------------------- memory sizes
@pytest.mark.parametrize("value, message", [
    (float("nan"), "must be a finite size"),
    (float("inf"), "must be a finite size"),
    (0.5, "less than one byte"),
    ("0.5", "less than one byte"),
    ("0.25B", "less than one byte"),
])
def test_memory_sizes_that_are_no_size_are_refused(value, message) -> None:
    with pytest.raises(HardwareError, match=message):
        parse_memory(value)


@pytest.mark.parametrize("line, message", [
    ("gpu_memory: .nan", "gpu_memory: memory size must be a finite size, got nan"),
    ("gpu_memory: .inf", "gpu_memory: memory size must be a finite size, got inf"),
    ("gpu_memory: '0.5'", "gpu_memory: memory size '0.5' is less than one byte"),
    ("gpu_memory: 24", "gpu_memory: memory size 24 has no unit, so it would mean 24 bytes; write a unit, e.g. '24GiB'"),
    ("gpu_memory: '512'", "has no unit, so it would mean 512 bytes; write a unit"),
])
def test_a_config_files_memory_size_is_read_with_a_unit(tmp_path, line, message) -> None:
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        read_config(_yaml(tmp_path, line))
    assert str(_yaml(tmp_path, line)) in str(err.value)


def test_sizes_with_a_unit_and_programs_byte_counts_keep_working() -> None:
    assert ElixirPlugin(gpu_memory="300000B").gpu_memory == "300000B"
    assert parse_memory(ElixirPlugin(gpu_memory=24 * 2**30).gpu_memory) == 24 * 2**30
    assert parse_memory(1024) == 1024 and parse_bytes("0.5KB") == 500
    with pytest.raises(ElixirConfigError, match="write a unit"):
        ElixirPlugin(gpu_memory=2**20 - 1)


def test_the_environment_and_the_command_line_need_a_unit_too(monkeypatch, capsys) -> None:
    monkeypatch.setenv("ELIXIR_GPU_MEMORY", "80")
    with pytest.raises(ElixirConfigError, match="gpu_memory: memory size '80' has no unit"):
        ElixirPlugin()
    monkeypatch.delenv("ELIXIR_GPU_MEMORY")
    for flag in ("--gpu-memory", "--host-memory"):
        assert main(["plan", "gpt2", "--hardware", "l4", flag, "24"]) == 2
        assert "memory size '24' has no unit" in capsys.readouterr().err


# ---------------------------------------------------------------------- numbers
@pytest.mark.parametrize("line, message", [
    ("chunk_size_mb: .nan", "chunk_size_mb: nan is not a finite number; write a number of at least 1e-06"),
    ("chunk_size_mb: .inf", "chunk_size_mb: inf is not a finite number"),
    ("rcache_blocks: .inf", "rcache_blocks: inf is not a finite number; write a whole number of at least 1"),
    ("batch_size: .inf", "batch_size: inf is not a finite number"),
    ("seq_len: true", "seq_len: True is not a whole number"),
    ("efficiency: .inf", "efficiency: inf is not one of auto, measure, calibrated or a finite, positive number"),
])
def test_a_config_files_numbers_are_finite(tmp_path, line, message) -> None:
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_config(_yaml(tmp_path, line))


def test_an_environment_number_is_finite(monkeypatch) -> None:
    monkeypatch.setenv("ELIXIR_CHUNK_SIZE_MB", "inf")
    with pytest.raises(ElixirConfigError, match="chunk_size_mb: 'inf' is not a finite number"):
        ElixirPlugin()


@pytest.mark.parametrize("efficiency", [float("nan"), float("inf")])
def test_the_planner_refuses_a_non_finite_efficiency_before_profiling(monkeypatch, efficiency) -> None:
    def profiled(*args, **kwargs):
        raise AssertionError("profiled the model before checking efficiency")

    monkeypatch.setattr(search, "profile_model", profiled)
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(PlanError, match="efficiency must be a finite, positive number"):
        search.plan(model, {"input": torch.zeros(1, 4)}, hardware="cpu", efficiency=efficiency)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_the_command_line_refuses_a_non_finite_efficiency(monkeypatch, capsys, value) -> None:
    def loaded(*args, **kwargs):
        raise AssertionError("loaded the model before checking --efficiency")

    import hf_elixir.cli as cli

    monkeypatch.setattr(cli, "load_config", loaded)
    assert main(["plan", "gpt2", "--hardware", "l4", "--efficiency", value]) == 2
    assert f"--efficiency {value}: use auto, measure, calibrated or a finite, positive number" in capsys.readouterr().err
