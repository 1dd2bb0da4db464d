"""Run scripts the way users do: ``accelerate launch``, ``hf-elixir launch``, one process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import torch
from transformers import TrainingArguments

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: holds the sitecustomize.py that gives plain reference runs a clean exit (see that file)
REFERENCE_SITE = Path(__file__).resolve().parent / "reference_site"
#: a calibration of a quiet 2-core machine, committed, for tests whose plans must not depend on
#: the machine they run on (test_oom_recovery) or that need a real calibration file to read
CALIBRATION = Path(__file__).resolve().parent / "data" / "calibration_2core_cpu.json"


def benchmark_module(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` loaded as a module, so that a test runs its ``main()`` (with
    ``sys.argv`` set) in this process."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    for key in [k for k in env if k.startswith("ELIXIR_") or k in ("ACCELERATE_USE_ELIXIR",)]:
        del env[key]
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env or worker_env(), capture_output=True, text=True, timeout=timeout)
    return proc


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def hf_elixir(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "hf_elixir.cli", *args], cwd, env, timeout)


def accelerate_launch(config: Path, port: int, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Plain Accelerate; on a CPU machine its multi-process path needs ACCELERATE_USE_CPU.

    Its processes end as hf_elixir's do (``REFERENCE_SITE``: the process groups destroyed at
    a normal exit, the script run through ``run_reference.py`` so that gloo threads which
    outlive the groups cannot abort the interpreter's teardown).
    """
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--main_process_port", str(port), str(REFERENCE_SITE / "run_reference.py"), str(SCRIPTS / script), *args]
    return check(run(cmd, cwd, reference_env()))


def reference_env() -> dict[str, str]:
    """The environment of a plain reference run: ``worker_env`` with ``REFERENCE_SITE`` first."""
    return worker_env(ACCELERATE_USE_CPU="true", PYTHONPATH=os.pathsep.join([str(REFERENCE_SITE), str(ROOT)]))


def elixir_launch(config: Path, port: int, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return check(hf_elixir("launch", "--config_file", str(config), "--main_process_port", str(port),
                           str(SCRIPTS / script), *args, cwd=cwd))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


#: the Trainer recipe of the launched Trainer tests (run_clm style, on the command line):
#: 48 samples, evaluation and checkpoints every 3 optimizer steps, clipping, warm-up
TRAINER_RECIPE = {
    "per_device_train_batch_size": "2", "per_device_eval_batch_size": "4", "gradient_accumulation_steps": "2",
    "max_grad_norm": "0.5", "learning_rate": "3e-3", "adam_epsilon": "1e-6", "weight_decay": "0.1",
    "warmup_steps": "2", "num_train_epochs": "1", "eval_strategy": "steps", "eval_steps": "3",
    "save_strategy": "steps", "save_steps": "3", "logging_steps": "1", "report_to": "none", "seed": "0",
    "optim": "adamw_torch", "disable_tqdm": "true",
}


#: the Trainer's flag for the model's own activation checkpointing: ``--activation_checkpointing``
#: from Transformers 5.2x on, ``--gradient_checkpointing`` before (later a deprecated alias)
CHECKPOINTING_FLAG = ("--activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
                      else "--gradient_checkpointing")


def trainer_args(**changes: str) -> list[str]:
    """``TRAINER_RECIPE`` as command-line flags, with ``changes`` applied."""
    unknown = set(changes) - set(TRAINER_RECIPE)
    assert not unknown, f"not in the recipe: {unknown}"
    return [item for key, value in {**TRAINER_RECIPE, **changes}.items() for item in (f"--{key}", value)]
