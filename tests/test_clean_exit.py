"""Every hf_elixir process exits cleanly: status 0, no abort, on every rank.

A process that reaches interpreter shutdown with gloo process groups alive (ordinary
scripts and the Trainer never call ``destroy_process_group()``), or with a collective still
running, can abort there ("terminate called without an active exception", SIGABRT). The
training script (scripts/exit_loop.py) runs three steps with an rCache smaller than its chunk
count, so the gathers the last optimizer step prefetches are still in flight when it ends,
and then ends without any cleanup, after ``model.close()``, or after Accelerate's
``end_training()``; each run must exit with status 0, print nothing of an abort on any rank,
and (without ``end_training``) have had its process groups destroyed by hf_elixir's exit
handler rather than left to the interpreter's teardown.

Destroying the groups does not join their threads when something else still holds a group
(a DDP reducer does): scripts/held_groups.py ends that way, with an all-gather in flight, and
aborts at teardown in about one run of four without help. Run through
``process_exit.run_script`` (the launcher's bootstrap and the plain references'
``run_reference.py``) it must end with the script's own status every time.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from harness import free_port
from hf_elixir.integrations.launch import accelerate_view, read_config
from hf_elixir.integrations.process_exit import REPORT_ENV
from integration_helpers import REFERENCE_SITE, SCRIPTS, accelerate_launch, hf_elixir, reference_env, run, worker_env

ABORT_SIGNS = ("terminate called", "Aborted", "SIGABRT", "Signal 6", "core dumped", "Exception ignored",
               "Traceback", "could not destroy")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    d = tmp_path_factory.mktemp("exit")
    proc = hf_elixir("config", "--non-interactive", "--num_processes", "2", "--use_cpu",
                     "--config_file", str(d / "elixir.yaml"), cwd=d)
    assert proc.returncode == 0, proc.stderr
    return d / "elixir.yaml"


@pytest.mark.parametrize("run, ending", list(enumerate(["none", "close", "none", "end_training", "none"])))
def test_training_run_exits_cleanly(config, tmp_path, run, ending) -> None:
    env = worker_env(ELIXIR_CHUNK_SIZE_MB="0.01", ELIXIR_RCACHE_BLOCKS="2")
    proc = hf_elixir("launch", "--config_file", str(config), "--main_process_port", str(free_port()),
                     str(SCRIPTS / "exit_loop.py"), "--ending", ending, cwd=tmp_path, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"run {run} ({ending}): exit {proc.returncode}\n{output[-6000:]}"
    for sign in ABORT_SIGNS:
        assert sign not in output, f"run {run} ({ending}): {sign!r} in the launcher's output\n{output[-6000:]}"
    assert "hf_elixir is active on 2 process(es)" in proc.stdout
    packing = re.search(r"(\d+) chunks of \d+ elements, rCache (\d+)", proc.stdout)
    assert packing and int(packing.group(2)) == 2 < int(packing.group(1))  # gathers left in flight
    for rank in (0, 1):
        assert f"rank {rank} trained" in proc.stdout
        assert f"rank {rank} process groups at exit: destroyed" in proc.stdout


def test_plain_reference_runs_exit_cleanly(config, tmp_path) -> None:
    """The plain ``accelerate launch`` runs the tests compare against get the same exit hygiene
    (tests/reference_site), so an upstream abort at teardown cannot fail a comparison."""
    probe = "import sitecustomize; print(sitecustomize.__file__)"
    found = subprocess.run([sys.executable, "-c", probe], env=reference_env(), capture_output=True, text=True)
    assert found.returncode == 0 and str(REFERENCE_SITE / "sitecustomize.py") in found.stdout, found.stderr
    plain, _ = accelerate_view(read_config(config), cuda=False)
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(plain))
    proc = accelerate_launch(tmp_path / "plain.yaml", free_port(), "exit_loop.py", "--ending", "none", cwd=tmp_path)
    output = proc.stdout + proc.stderr
    for sign in ABORT_SIGNS:
        assert sign not in output, f"{sign!r} in the reference launcher's output\n{output[-6000:]}"
    for rank in (0, 1):
        assert f"rank {rank} trained" in proc.stdout


def _held_groups(ending: str, tmp_path, launcher: str, config=None) -> tuple[subprocess.CompletedProcess, str]:
    """scripts/held_groups.py on two ranks, under torchrun through the reference runner or
    under ``hf-elixir launch`` (the bootstrap), with the exit step reporting its path."""
    script = [str(SCRIPTS / "held_groups.py"), "--ending", ending]
    if launcher == "reference":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(REFERENCE_SITE / "run_reference.py"), *script]
        proc = run(cmd, tmp_path, dict(reference_env(), **{REPORT_ENV: "1"}))
    else:
        proc = hf_elixir("launch", "--config_file", str(config), "--main_process_port", str(free_port()), *script,
                         cwd=tmp_path, env=worker_env(**{REPORT_ENV: "1"}))
    return proc, proc.stdout + proc.stderr


@pytest.mark.parametrize("launcher", ["reference", "hf_elixir"])
@pytest.mark.parametrize("run_index", range(3))
def test_threads_that_outlive_their_groups_cannot_abort_a_finished_run(config, tmp_path, launcher, run_index) -> None:
    proc, output = _held_groups("normal", tmp_path, launcher, config)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output[-6000:]}"
    for sign in ABORT_SIGNS:
        assert sign not in output, f"{sign!r} in the output\n{output[-6000:]}"
    for rank in (0, 1):
        assert f"rank {rank} done" in proc.stdout
    # each rank took the final exit step with the script's status: under torchrun the DDP
    # reducer keeps the threads past destroy (the hazard was real) and the process ends
    # before the teardown; under the launcher the threads may also have gone with the groups
    ended = output.count("gloo worker threads outlived their process groups; ending with status 0")
    if launcher == "reference":
        assert ended == 2, output[-6000:]
    else:
        assert ended + output.count("no gloo worker threads left; status 0") == 2, output[-6000:]


def _ranks_by_hand(ending: str, tmp_path) -> list[tuple[int, str]]:
    """scripts/held_groups.py on two ranks started directly (no launcher), through the
    reference runner: each rank's status and output, with nobody ending one rank because the
    other finished first (torchrun sends SIGTERM to the rest once any rank fails, so under it
    whether the slower rank reaches its exit step is a race)."""
    port = str(free_port())
    script = [str(REFERENCE_SITE / "run_reference.py"), str(SCRIPTS / "held_groups.py"), "--ending", ending]
    procs = []
    for rank in (0, 1):
        env = dict(reference_env(), **{REPORT_ENV: "1"}, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, *script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    return [(proc.returncode, output) for proc, output in zip(procs, outputs)]


@pytest.mark.parametrize("ending, status", [("exit3", 3), ("message", 1)])
def test_a_script_that_exits_keeps_its_status(config, tmp_path, ending, status) -> None:
    """Ending before the teardown keeps the status a script asked for: ``sys.exit(3)`` is 3,
    ``SystemExit("message")`` prints the message and is 1, on every rank (started by hand, so
    each rank's own status is seen), and torchrun reports that status as the run's cause."""
    for rank, (code, output) in enumerate(_ranks_by_hand(ending, tmp_path)):
        assert code == status, f"rank {rank}: exit {code}\n{output[-6000:]}"
        assert f"rank {rank} done" in output, output[-6000:]
        assert f"ending with status {status} before" in output, output[-6000:]
        assert "terminate called" not in output
        if ending == "message":
            assert "ending with a message" in output
    proc, output = _held_groups(ending, tmp_path, "reference")
    assert proc.returncode != 0
    assert f"ending with status {status} before" in output, output[-6000:]
    assert re.search(rf"exitcode\s*:\s*{status}\b", output), output[-6000:]
    assert "terminate called" not in output
