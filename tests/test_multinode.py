"""Several machines: two ``hf-elixir launch`` processes acting as machine 0 and machine 1 on
this host (``num_machines: 2``, 2 processes each, 4 ranks) train a Trainer script, save a
checkpoint, and that checkpoint resumes on one machine of 4 processes.

References: the same script under plain ``accelerate launch`` with 4 processes on one machine
(DDP), and the two-machine run itself for the resumed one. The plan made at launch must know
it spans 2 machines (its summary names them and the link it priced); the one-machine run's
must not. The planner's pricing of the link and ``hf-elixir config``'s machine settings are
checked here too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import GPT2Config, GPT2LMHeadModel

from harness import free_port
from hf_elixir import cli
from hf_elixir.integrations.launch import (LaunchError, accelerate_view, default_config, read_config,
                                           write_config)
from hf_elixir.integrations.planning import machines_from_env
from hf_elixir.integrations.plugin import ElixirPlugin
from hf_elixir.planner.record import PlanError
from hf_elixir.planner.search import plan
from integration_helpers import (SCRIPTS, accelerate_launch, check, elixir_launch, max_diff, trainer_args,
                                 worker_env)

SCRIPT = "trainer_run.py"
# 48 samples, 2 per device, 4 processes, no accumulation: 6 optimizer steps, a checkpoint at 3
TRAIN_ARGS = trainer_args(per_device_eval_batch_size="2", gradient_accumulation_steps="1")
TWO_MACHINES = "world size 4 (2 machines x 2 ranks"


def machine_configs(d, port: int) -> list:
    """One config file per machine, as `hf-elixir config` writes them on each."""
    paths = []
    for rank in (0, 1):
        path = d / f"machine{rank}.yaml"
        check(subprocess.run(
            [sys.executable, "-m", "hf_elixir.cli", "config", "--non-interactive", "--use_cpu",
             "--num_processes", "4", "--num_machines", "2", "--machine_rank", str(rank),
             "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--config_file", str(path)],
            cwd=d, env=worker_env(), capture_output=True, text=True, timeout=120))
        paths.append(path)
    return paths


def launch_two_machines(configs, d, *args: str) -> list[subprocess.CompletedProcess]:
    """Start machine 1's launcher, then machine 0's, and wait for both (each under a timeout)."""
    procs = []
    for rank in (1, 0):
        cmd = [sys.executable, "-m", "hf_elixir.cli", "launch", "--config_file", str(configs[rank]),
               str(SCRIPTS / SCRIPT), *args]
        procs.append(subprocess.Popen(cmd, cwd=d, env=worker_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc in done:
        check(proc)
    return done[::-1]  # machine 0 first


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("multinode")
    configs = machine_configs(d, free_port())
    machines = launch_two_machines(configs, d, "--output_dir", str(d / "two"), "--result", str(d / "two.pt"),
                                   *TRAIN_ARGS)
    one = d / "one.yaml"
    write_config(one, default_config(4, use_gpu=False), ElixirPlugin(plan="auto"))
    plain_cfg, _ = accelerate_view(read_config(one), cuda=False)
    (d / "plain.yaml").write_text(yaml.safe_dump(plain_cfg))
    accelerate_launch(d / "plain.yaml", free_port(), SCRIPT, "--output_dir", str(d / "plain"),
                      "--result", str(d / "plain.pt"), *TRAIN_ARGS, cwd=d)
    return d, machines, torch.load(d / "two.pt"), torch.load(d / "plain.pt")


def test_two_machines_train_like_four_plain_processes(runs) -> None:
    """Acceptance 2: num_machines 2 x 2 processes under hf-elixir launch equals 4 DDP
    processes on one machine, and the launched plan priced 2 machines."""
    _, machines, two, plain = runs
    assert two["is_elixir"] and two["world"] == 4 and not plain["is_elixir"] and plain["world"] == 4
    assert two["global_step"] == plain["global_step"] == 6
    assert two["evals"] == pytest.approx(plain["evals"], rel=1e-5)
    assert max_diff(two["state"], plain["state"]) < 2e-5
    main = machines[0].stdout
    assert "hf_elixir is active on 4 process(es)" in main
    assert TWO_MACHINES in main and "collectives across machines priced at" in main, main[-3000:]


def test_two_machine_checkpoint_resumes_on_one_machine(runs, tmp_path) -> None:
    """Acceptance 2: the checkpoint both machines wrote at step 3 resumes on one machine of 4
    processes and ends where the uninterrupted two-machine run ended; that plan knows it is
    on one machine."""
    d, _, two, _ = runs
    ckpt = d / "two" / "checkpoint-3"
    assert (ckpt / "elixir_state" / "elixir_index.json").is_file()
    out = tmp_path / "resumed"
    shutil.copytree(ckpt, out / "checkpoint-3")
    proc = elixir_launch(d / "one.yaml", free_port(), SCRIPT, "--output_dir", str(out), "--result",
                         str(tmp_path / "r.pt"), "--resume_from_checkpoint", str(out / "checkpoint-3"),
                         *TRAIN_ARGS, cwd=tmp_path)
    resumed = torch.load(tmp_path / "r.pt")
    assert resumed["is_elixir"] and resumed["world"] == 4 and resumed["global_step"] == 6
    assert max_diff(resumed["state"], two["state"]) < 2e-6
    assert "world size 4 on" in proc.stdout and "machines x" not in proc.stdout


# ---------------------------------------------------------------------- the planner's side
@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4))


def test_a_plan_over_two_machines_prices_their_link(gpt2) -> None:
    one = plan(gpt2, (2, 32), hardware="a100-80g", world_size=16, nodes=1, efficiency="calibrated")
    two = plan(gpt2, (2, 32), hardware="a100-80g", world_size=16, nodes=2, efficiency="calibrated")
    assert one.predictions["nodes"] == 1 and two.predictions["nodes"] == 2
    assert one.predictions["ranks_per_node"] == 16 and two.predictions["ranks_per_node"] == 8
    # the same work over the slower link between machines takes longer
    assert two.predictions["step_time_s"] > one.predictions["step_time_s"]
    assert "2 machines x 8 ranks" in two.summary() and "machines x" not in one.summary()
    with pytest.raises(PlanError, match="spread evenly over 3 machine"):
        plan(gpt2, (2, 32), hardware="a100-80g", world_size=16, nodes=3, efficiency="calibrated")


@pytest.mark.parametrize("env, machines", [
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, 2),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, 1),
    ({}, 1),                                            # no launcher: one machine
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3"}, 1),  # uneven: not a shape torchrun makes
])
def test_machines_follow_the_launchers_environment(monkeypatch, env, machines) -> None:
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert machines_from_env(4) == machines


# ---------------------------------------------------------------------- hf-elixir config
def test_config_asks_for_the_machine_settings(tmp_path, monkeypatch) -> None:
    import builtins

    answers = iter(["2", "1", "10.0.0.5", "29600", "8", "no", "", "auto", "auto"])
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(answers))
    out = tmp_path / "m1.yaml"
    assert cli.main(["config", "--use_cpu", "--config_file", str(out)]) == 0
    acc = read_config(out).accelerate
    assert (acc["num_machines"], acc["machine_rank"], acc["main_process_ip"], acc["main_process_port"],
            acc["num_processes"]) == (2, 1, "10.0.0.5", 29600, 8)


@pytest.mark.parametrize("flags, message", [
    (["--num_machines", "2", "--num_processes", "4"], "needs main_process_ip"),
    (["--num_machines", "2", "--num_processes", "3", "--main_process_ip", "10.0.0.5"], "divisible by num_machines"),
    (["--num_machines", "2", "--machine_rank", "2", "--num_processes", "4", "--main_process_ip", "h"],
     "machine_rank 2 is not one of 0..1"),
])
def test_config_refuses_an_inconsistent_cluster(tmp_path, capsys, flags, message) -> None:
    out = tmp_path / "c.yaml"
    assert cli.main(["config", "--non-interactive", "--use_cpu", *flags, "--config_file", str(out)]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_launch_refuses_a_hand_written_cluster_without_the_main_address(tmp_path) -> None:
    cfg = default_config(4, use_gpu=False)
    cfg["num_machines"] = 2
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**cfg, "elixir": {}}))
    with pytest.raises(LaunchError, match="needs main_process_ip"):
        read_config(path)
