"""Fault injection: a process saving a checkpoint is SIGKILLed at many points of the save;
after every kill the previous checkpoint (or, past the commit rename, the new complete one)
loads and resumes exactly, and the partial one is never loaded. See ckpt_kill_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "ckpt_kill_worker.py"


def test_sigkill_during_save_never_loses_the_checkpoint(tmp_path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HF_ELIXIR_CKPT_FAULT_AT", None)
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), "3"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.split("RESULT ", 1)[1])
    labels, commit, kills = r["labels"], r["commit_index"], r["kills"]
    from_a, from_b = r["reference_from_A"], r["reference_from_B"]
    assert from_a != from_b

    # the kill points cover every file, every fsync and every step of the swap
    killed = [k["label"] for k in kills]
    assert len(kills) >= 20
    for what in ("write model-rank", "write optimizer-rank", "fsync model-rank", "fsync optimizer-rank",
                 "fsync model-untracked", "write optimizer_state.json", "write elixir_index.json",
                 "fsync elixir_index.json", "rename A ->", "rename A.tmp-", "delete A.old-"):
        assert any(l.startswith(what) for l in killed), f"no kill point at {what!r}"

    lost = []
    for k in kills:
        assert k["sigkilled"], f"kill point {k['k']} ({k['label']}): the saver was not SIGKILLed"
        got = k["got"]
        # before the commit rename the old checkpoint must come back, after it the new one
        want_step, want = (2, from_a) if k["k"] - 1 <= commit else (3, from_b)
        if "error" in got or got["step"] != want_step or got["losses"] != want or got["lrs"] != (
                r["lrs_from_A"] if want_step == 2 else r["lrs_from_B"]):
            lost.append((k["k"], k["label"], got))
        # saving again over the debris works and leaves only the checkpoint behind
        assert k["resave_ok"] and k["again"].get("step") == 3 and k["again"]["losses"] == from_b, k
        assert k["left"] == ["A"], f"after kill {k['k']} and a new save the folder holds {k['left']}"
    assert not lost, f"{len(lost)} of {len(kills)} kill points lost the checkpoint: {lost[:3]}"

    # killed during a first save: nothing to fall back to, so load refuses (and says why) or,
    # past the commit rename, finds the complete new checkpoint
    for f in r["first_save"]:
        assert f["sigkilled"]
        if "error" in f["got"]:
            assert "interrupted save" in f["got"]["error"] and ".tmp-" in f["got"]["error"]
        else:
            assert f["k"] - 1 >= labels.index(next(l for l in labels if l.startswith("rename A.tmp-"))) - 2
            assert f["got"]["step"] == 3 and f["got"]["losses"] == from_b
    assert any("error" in f["got"] for f in r["first_save"])
    print(f"kill points tried: {len(kills)} of {len(labels)}; lost: {len(lost)}; {r['seconds']:.1f}s")
