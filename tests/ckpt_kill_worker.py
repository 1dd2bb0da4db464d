"""Fault injection for checkpoint saves: SIGKILL a real saving process at every point.

Run as ``python ckpt_kill_worker.py WORKDIR [STRIDE]``; prints one JSON line with the results.

A tiny GPT-2 (world size 1, half the chunks' optimizer state offloaded) trains 2 steps and
saves checkpoint A; it trains one more step. Then, for every durable operation k of a save
(each tensor write, fsync, JSON file, the index, each rename and delete), a forked child
process saves the new state over a fresh copy of A with ``HF_ELIXIR_CKPT_FAULT_AT=k``, so the
saver SIGKILLs itself just before its k-th operation. After each kill the parent loads
whatever the directory holds into a separate model, trains 2 steps, and records the losses
and which checkpoint it got; then it saves again over the debris and checks the directory
is clean. A few kills during a first save (no previous checkpoint) must make load() refuse.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from ckpt_common import Run  # noqa: E402
from hf_elixir import checkpoint as ck  # noqa: E402
from hf_elixir.checkpoint import atomic  # noqa: E402

PLAN = dict(chunk_size=4096, offload_fraction=0.5)


def count_points(run: Run, work: Path) -> list[str]:
    recorder = atomic.FaultInjector(None)
    real = atomic.FaultInjector.from_env
    atomic.FaultInjector.from_env = classmethod(lambda cls, rank: recorder)
    try:
        shutil.copytree(work / "A", work / "count" / "A")
        ck.save(run.emodel, run.eopt, work / "count" / "A", extra={"step": 3}, scheduler=run.sched)
    finally:
        atomic.FaultInjector.from_env = real
    shutil.rmtree(work / "count")
    return recorder.labels


def save_in_child(run: Run, target: Path, kill_at: int | None) -> int:
    """Fork; the child saves (killing itself at ``kill_at``); returns the child's wait status."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if kill_at is not None:
                os.environ[atomic.FAULT_ENV] = str(kill_at)
            ck.save(run.emodel, run.eopt, target, extra={"step": 3}, scheduler=run.sched)
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def try_resume(resume: Run, target: Path) -> dict:
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            info = ck.load(resume.emodel, resume.eopt, target, scheduler=resume.sched)
        except ck.CheckpointError as e:
            return {"error": str(e)}
    return {"step": info["extra"]["step"], **resume.steps(2)}


def main(work: Path, stride: int) -> dict:
    torch.set_num_threads(1)
    t0 = time.time()
    run = Run(0, 1, plan_kwargs=PLAN)
    resume = Run(0, 1, plan_kwargs=PLAN, seed=1)
    run.steps(2)
    ck.save(run.emodel, run.eopt, work / "A", extra={"step": 2}, scheduler=run.sched)
    after_a = run.steps(1)
    labels = count_points(run, work)
    commit = labels.index(next(l for l in labels if l.startswith("rename ") and l.endswith("-> A")))

    # every fsync, JSON file, rename and delete; every ``stride``-th tensor write
    chosen = [k for k in range(1, len(labels) + 1)
              if not labels[k - 1].startswith("write ") or ".safetensors:" not in labels[k - 1] or k % stride == 1]
    kills = []
    for k in chosen:
        case = work / f"k{k:04d}"
        case.mkdir()
        shutil.copytree(work / "A", case / "A")
        status = save_in_child(run, case / "A", k)
        got = try_resume(resume, case / "A")
        # saving again over whatever the kill left must work and leave a clean directory
        status2 = save_in_child(run, case / "A", None)
        again = try_resume(resume, case / "A")
        kills.append({
            "k": k, "label": labels[k - 1],
            "sigkilled": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
            "got": got, "resave_ok": os.WIFEXITED(status2) and os.WEXITSTATUS(status2) == 0,
            "again": again, "left": sorted(os.listdir(case)),
        })
        shutil.rmtree(case)

    first_save = []
    for k in (1, len(labels) // 2, commit):  # killed during the first save into an empty place
        case = work / f"first{k}"
        case.mkdir()
        status = save_in_child(run, case / "A", k)
        first_save.append({"k": k, "label": labels[k - 1],
                           "sigkilled": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
                           "got": try_resume(resume, case / "A")})
        shutil.rmtree(case)

    rest = run.steps(2)  # the uninterrupted run: steps 4 and 5
    return {
        "labels": labels, "commit_index": commit,
        "reference_from_A": after_a["losses"] + rest["losses"][:1],
        "reference_from_B": rest["losses"],
        "lrs_from_A": after_a["lrs"] + rest["lrs"][:1],
        "lrs_from_B": rest["lrs"],
        "kills": kills, "first_save": first_save, "seconds": time.time() - t0,
    }


if __name__ == "__main__":
    result = main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    print("RESULT " + json.dumps(result))
