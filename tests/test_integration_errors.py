"""Bad input to the integrations: a clear error, before any worker starts or model is sharded."""

from __future__ import annotations

import builtins
import json
import sys

import pytest
import torch
import yaml
from transformers import HfArgumentParser

from harness import free_port, run_distributed
from hf_elixir import cli
from hf_elixir.integrations.launch import LaunchError, read_config
from hf_elixir.integrations.planning import make_plan
from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin
from hf_elixir.integrations.trainer import ElixirTrainingArguments
from hf_elixir.planner.record import ElixirPlan, PlanError
from integration_helpers import SCRIPTS, hf_elixir
from tiny_models import make_model


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in [k for k in os.environ if k.startswith("ELIXIR_") or k == "ACCELERATE_USE_ELIXIR"]:
        monkeypatch.delenv(key)


# ---------------------------------------------------------------------- plugin options
@pytest.mark.parametrize("options, message", [
    ({"offload": "sometimes"}, "offload"),
    ({"offload": 1.5}, "fraction between 0 and 1"),
    ({"activation_checkpointing": "maybe"}, "activation_checkpointing"),
    ({"rcache_blocks": 0}, "at least 1"),
    ({"rcache_blocks": 2.5}, "not a whole number"),
    ({"gpu_memory": "lots"}, "gpu_memory"),
    ({"hardware": "abacus"}, "unknown hardware preset"),
    ({"efficiency": "quick"}, "efficiency"),
    ({"efficiency": -1}, "positive number"),
    ({"plan": "/no/such/plan.json"}, "hf-elixir plan"),
    ({"ofload": "all"}, "unknown elixir option"),
])
def test_bad_plugin_options(options, message) -> None:
    with pytest.raises(ElixirConfigError, match=message):
        ElixirPlugin.from_dict(options)


def test_plugin_reads_environment(monkeypatch) -> None:
    monkeypatch.setenv("ELIXIR_OFFLOAD", "0.5")
    monkeypatch.setenv("ELIXIR_RCACHE_BLOCKS", "3")
    plugin = ElixirPlugin(activation_checkpointing="on")
    assert plugin.offload == 0.5 and plugin.rcache_blocks == 3 and plugin.activation_checkpointing == "on"
    assert plugin.pinned == {"rcache_blocks": 3, "offload": 0.5, "activation_checkpointing": "on"}
    env = plugin.to_env()
    assert env["ACCELERATE_USE_ELIXIR"] == "true" and env["ELIXIR_OFFLOAD"] == "0.5"
    monkeypatch.setenv("ELIXIR_EFFICIENCY", "1.25")
    assert ElixirPlugin().efficiency == 1.25 and ElixirPlugin(efficiency="Calibrated").efficiency == "calibrated"
    monkeypatch.setenv("ELIXIR_SEQ_LEN", "long")
    with pytest.raises(ElixirConfigError, match="seq_len"):
        ElixirPlugin()


# ---------------------------------------------------------------------- Trainer arguments
def test_training_arguments_parse_elixir_flags(tmp_path) -> None:
    parser = HfArgumentParser(ElixirTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--elixir", "--elixir_config", '{"offload": "none", "seq_len": 64}'])
    assert args.elixir and args.elixir_plugin.offload == "none" and args.elixir_plugin.seq_len == 64
    assert args.place_model_on_device is False


def test_training_arguments_honour_accelerate_use_elixir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_ELIXIR", "true")
    monkeypatch.setenv("ELIXIR_OFFLOAD", "all")
    args = ElixirTrainingArguments(output_dir=str(tmp_path))
    assert args.elixir and args.elixir_plugin.offload == "all"


@pytest.mark.parametrize("kwargs, message", [
    ({"elixir_config": '{"offload": "sometimes"}'}, "offload"),
    ({"elixir_config": '{"chunk_size": 4}'}, "unknown elixir option"),
    ({"elixir_config": "{not json"}, "not valid JSON"),
    ({"optim": "adafactor"}, "adamw_torch"),
    ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "deepspeed"),
    ({"fsdp": "full_shard"}, "fsdp"),
])
def test_bad_trainer_arguments(tmp_path, kwargs, message) -> None:
    with pytest.raises(ElixirConfigError, match=message):
        ElixirTrainingArguments(output_dir=str(tmp_path), elixir=True, **kwargs)


def test_elixir_config_without_elixir_is_an_error(tmp_path) -> None:
    with pytest.raises(ElixirConfigError, match="add --elixir"):
        ElixirTrainingArguments(output_dir=str(tmp_path), elixir_config='{"offload": "none"}')


# ---------------------------------------------------------------------- plans
def test_plan_for_another_model_or_world_size_is_refused_untouched(tmp_path) -> None:
    model = make_model("gpt2")
    other = make_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ElixirPlan.simple(other, world_size=2).to_json(tmp_path / "llama.json")
    ElixirPlan.simple(model, world_size=4).to_json(tmp_path / "gpt2_w4.json")
    for name in ("llama.json", "gpt2_w4.json"):
        plugin = ElixirPlugin(plan=str(tmp_path / name))
        with pytest.raises(PlanError, match="does not fit this run"):
            make_plan(model, plugin, world_size=2, dtype="fp32", optimizer="adamw", batch_shape=(2, 16))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _prepare_with(rank: int, world: int, what: str) -> str:
    import os

    from hf_elixir.integrations.accelerate import ElixirAccelerator

    os.environ["ACCELERATE_USE_CPU"] = "true"
    model = make_model("gpt2")
    acc = ElixirAccelerator(elixir_plugin=ElixirPlugin(batch_size=2, seq_len=16))
    opt = torch.optim.RMSprop(model.parameters()) if what == "optimizer" else torch.optim.AdamW(model.parameters())
    try:
        if what == "optimizer":
            acc.prepare(model, opt)
        else:  # the optimizer before its model, in a separate call
            acc.prepare(opt)
    except (ElixirConfigError, ValueError) as e:
        untouched = all(p.numel() > 0 for p in model.parameters()) and not hasattr(model, "_hf_elixir_wrapped")
        return f"{type(e).__name__}: {e} | untouched={untouched}"
    return "no error"


def test_unsupported_optimizer_is_refused_before_sharding() -> None:
    out = run_distributed(_prepare_with, 2, "optimizer")
    assert all("RMSprop" in r and "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD" in r and "untouched=True" in r
               for r in out), out


def test_optimizer_prepared_before_its_model_is_explained() -> None:
    out = run_distributed(_prepare_with, 2, "order")
    assert all("prepare the model before or together with its optimizer" in r for r in out), out


# ---------------------------------------------------------------------- config files and the launcher
def test_config_non_interactive_round_trip(tmp_path) -> None:
    out = tmp_path / "c.yaml"
    assert cli.main(["config", "--non-interactive", "--num_processes", "2", "--use_cpu", "--offload", "0.25",
                     "--gpu_memory", "8GiB", "--config_file", str(out)]) == 0
    cfg = read_config(out)
    assert cfg.plugin.offload == 0.25 and cfg.plugin.gpu_memory == "8GiB"
    assert cfg.accelerate["num_processes"] == 2 and "elixir" not in cfg.accelerate


def test_config_interactive_prompts(tmp_path, monkeypatch, capsys) -> None:
    answers = iter(["1", "3", "no", "12GiB", "half", "0.5", "on"])  # "half" is refused and asked again
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(answers))
    out = tmp_path / "c.yaml"
    assert cli.main(["config", "--use_cpu", "--config_file", str(out)]) == 0
    cfg = read_config(out)
    assert cfg.accelerate["num_processes"] == 3
    assert (cfg.plugin.gpu_memory, cfg.plugin.offload, cfg.plugin.activation_checkpointing) == ("12GiB", 0.5, "on")
    assert "try again" in capsys.readouterr().err


def test_config_rejects_a_bad_flag(tmp_path, capsys) -> None:
    assert cli.main(["config", "--non-interactive", "--offload", "lots", "--config_file", str(tmp_path / "c.yaml")]) == 2
    assert "offload" in capsys.readouterr().err and not (tmp_path / "c.yaml").exists()


@pytest.mark.parametrize("section, message", [
    ({"offlaod": "all"}, "unknown elixir option"),
    ({"offload": "everything"}, "offload"),
    ("yes", "must be a mapping"),
])
def test_launch_rejects_bad_elixir_section_before_any_worker(tmp_path, section, message) -> None:
    cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2,
           "num_machines": 1, "use_cpu": True, "elixir": section}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    marker = tmp_path / "started"
    from integration_helpers import worker_env

    proc = hf_elixir("launch", "--config_file", str(tmp_path / "bad.yaml"), "--main_process_port", str(free_port()),
                     str(SCRIPTS / "trainer_run.py"), "--output_dir", str(tmp_path / "o"), cwd=tmp_path,
                     env=worker_env(TEST_STARTED_MARKER=str(marker)))
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr and "bad.yaml" in proc.stderr
    assert not marker.exists()  # no worker ran


def test_launch_refuses_deepspeed_config(tmp_path) -> None:
    cfg = {"distributed_type": "DEEPSPEED", "num_processes": 2, "elixir": {"plan": "auto"}}
    (tmp_path / "ds.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(LaunchError, match="DEEPSPEED"):
        read_config(tmp_path / "ds.yaml")


def test_plugin_json_round_trip(tmp_path) -> None:
    (tmp_path / "e.json").write_text(json.dumps({"offload": "all", "batch_size": 4}))
    plugin = ElixirPlugin.from_json(str(tmp_path / "e.json"))
    assert plugin.offload == "all" and plugin.batch_size == 4


@pytest.mark.parametrize("env, kwargs, message", [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, {}, "DeepSpeed"),
    ({"ACCELERATE_USE_FSDP": "true"}, {}, "FSDP"),
    ({}, {"fsdp_plugin": object()}, "FSDP"),
])
def test_accelerator_refuses_other_sharding(monkeypatch, env, kwargs, message) -> None:
    from hf_elixir.integrations.accelerate import ElixirAccelerator

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ElixirConfigError, match=message):
        ElixirAccelerator(elixir_plugin=ElixirPlugin(), **kwargs)
