"""Run scripts the way users do: ``accelerate launch``, ``hf-elixir launch``, one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


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
    """Plain Accelerate; on a CPU machine its multi-process path needs ACCELERATE_USE_CPU."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--main_process_port", str(port), str(SCRIPTS / script), *args]
    return check(run(cmd, cwd, worker_env(ACCELERATE_USE_CPU="true")))


def elixir_launch(config: Path, port: int, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return check(hf_elixir("launch", "--config_file", str(config), "--main_process_port", str(port),
                           str(SCRIPTS / script), *args, cwd=cwd))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
