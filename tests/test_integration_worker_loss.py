"""Acceptance 7: a worker killed mid-training under `hf-elixir launch` stops the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from harness import free_port
from hf_elixir.integrations.launch import default_config, write_config
from hf_elixir.integrations.plugin import ElixirPlugin
from integration_helpers import SCRIPTS, worker_env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read() and _alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_sigkill_of_one_worker_stops_the_other_and_names_it(tmp_path) -> None:
    config = write_config(tmp_path / "elixir.yaml", default_config(2, use_gpu=False),
                          ElixirPlugin(batch_size=2, seq_len=16))
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = [sys.executable, "-m", "hf_elixir.cli", "launch", "--config_file", str(config),
           "--main_process_port", str(free_port()), str(SCRIPTS / "endless_loop.py"), "--pids", str(pids)]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while len(list(pids.iterdir())) < 2:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.5)
        time.sleep(1.0)  # both are inside training steps now
        victim = int((pids / "rank1").read_text())
        survivor = int((pids / "rank0").read_text())
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        out, err = launcher.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, err[-3000:]
    assert "worker rank 1" in err and "SIGKILL" in err, err[-3000:]
    assert not _alive(survivor) and not _alive(victim)
    assert _processes_mentioning(str(pids)) == []  # nothing left behind
