"""Checkpoint readers against a crafted or damaged checkpoint, and one rank's unexpected
error (issue 60, finding 1).

- A file name from the index (``files``, ``rank_files``, ``hf_files``) that leaves the
  folder (``../``) or is a symlink out of it is refused by load, by the reshard reader and by
  export, before anything is written: the whole tree around the checkpoint is compared
  before and after.
- A same-size edit of ``scheduler.json``, ``optimizer_state.json`` or ``extra.json`` is
  refused on load by its recorded sha256; the model and optimizer are unchanged.
- A ``ValueError`` or ``KeyError`` on one rank of a 2-rank save or load reaches the other
  rank as a ``CheckpointError`` naming the failing rank (not as a process-group timeout),
  while the failing rank raises its own exception with its traceback.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ckpt_common import Run, assert_same_local_state
from harness import run_distributed
from hf_elixir import checkpoint as ck
from hf_elixir.checkpoint.index import INDEX_NAME, UNTRACKED_NAME
from hf_elixir.checkpoint.io import file_sha256
from hf_elixir.checkpoint.reshard import SavedSlices

MODEL_FILE = "model-rank-00000-of-00001.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 1-rank checkpoint with optimizer, scheduler and extra state (never modified)."""
    d = tmp_path_factory.mktemp("hardening") / "ckpt"
    run = Run(0, 1)
    run.steps(1)
    ck.save(run.emodel, run.eopt, d, extra={"step": 1}, scheduler=run.sched)
    return d


@pytest.fixture(scope="module")
def victim():
    """A model every refusal leaves as it was (each test checks); nothing loads into it."""
    run = Run(0, 1, seed=4)
    run.steps(1)
    return run


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (symlinks as their targets' names) and its contents."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p)] = b"-> " + os.readlink(p).encode()
        elif p.is_file():
            out[str(p)] = p.read_bytes()
    return out


def _layout(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``tmp/a/ckpt`` (a copy of the checkpoint) and the export target ``tmp/b/c/out``: a
    ``../../x`` name resolves to different places from the two, so a copy made through it
    lands outside both (and is not the source file itself)."""
    ckpt = tmp_path / "a" / "ckpt"
    shutil.copytree(saved, ckpt)
    (tmp_path / "b" / "c").mkdir(parents=True)
    return ckpt, tmp_path / "b" / "c" / "out"


def _plant(ckpt: Path, index: dict, src: str, outside: Path) -> str:
    """Copy checkpoint file ``src`` to ``outside`` and list it in ``files`` under the name that
    reaches it from the checkpoint folder, with its true size and hash; return that name."""
    shutil.copyfile(ckpt / src, outside)
    name = os.path.relpath(outside, ckpt)
    assert name.startswith("..")
    index["files"][name] = {**index["files"][src], "size": outside.stat().st_size, "sha256": file_sha256(outside)}
    return name


def _craft(ckpt: Path, key: str, tmp_path: Path) -> tuple[dict, str]:
    """Point one entry of ``key`` at a file outside the checkpoint; the index that says so."""
    index = json.loads((ckpt / INDEX_NAME).read_text())
    if key == "files":        # an extra listed file, outside
        name = _plant(ckpt, index, UNTRACKED_NAME, tmp_path / "planted.safetensors")
    elif key == "rank_files":  # the rank's model file read from outside
        name = _plant(ckpt, index, MODEL_FILE, tmp_path / "planted.safetensors")
        index["rank_files"][0]["model"] = name
    else:                      # a config file export would copy from outside, to outside
        name = _plant(ckpt, index, "config.json", tmp_path / "config.json")
        index["hf_files"].append(name)
    (ckpt / INDEX_NAME).write_text(json.dumps(index))
    return index, name


def _refused_everywhere(victim: Run, ckpt: Path, out: Path, index: dict, needle: str, tmp_path: Path) -> None:
    """load, the reshard reader and export all refuse, naming ``needle``; nothing is written
    anywhere (no output folder, no temporary folder, no file outside) and the victim's state
    is unchanged."""
    tree = _tree(tmp_path)
    with pytest.raises(ck.CheckpointError) as exc:
        ck.export(ckpt, out)
    assert needle in str(exc.value), str(exc.value)
    assert _tree(tmp_path) == tree, "a file was written"
    assert not out.exists() and not list(out.parent.iterdir())
    before = victim.local_state()
    with pytest.raises(ck.CheckpointError) as exc:
        ck.load(victim.emodel, victim.eopt, ckpt, scheduler=victim.sched)
    assert needle in str(exc.value), str(exc.value)
    assert_same_local_state(before, victim.local_state())
    with pytest.raises(ck.CheckpointError) as exc:
        SavedSlices(ckpt, index)
    assert needle in str(exc.value), str(exc.value)
    assert _tree(tmp_path) == tree


@pytest.mark.parametrize("key", ["files", "rank_files", "hf_files"])
def test_a_name_that_leaves_the_folder_is_refused_by_every_reader(saved, victim, tmp_path, key) -> None:
    ckpt, out = _layout(saved, tmp_path)
    index, name = _craft(ckpt, key, tmp_path)
    _refused_everywhere(victim, ckpt, out, index, f"{name!r} is not a plain file name", tmp_path)


@pytest.mark.parametrize("name", ["", ".", "..", "/etc/passwd", "sub/x", "a\\b", "x\x00y"])
def test_odd_names_are_refused_before_anything_is_read(saved, victim, tmp_path, name) -> None:
    ckpt, out = _layout(saved, tmp_path)
    index = json.loads((ckpt / INDEX_NAME).read_text())
    index["hf_files"].append(name)
    index["files"][name] = dict(index["files"]["config.json"])
    (ckpt / INDEX_NAME).write_text(json.dumps(index))
    _refused_everywhere(victim, ckpt, out, index, repr(name), tmp_path)


@pytest.mark.parametrize("fname", [MODEL_FILE, "config.json"])
def test_a_symlink_out_of_the_folder_is_refused(saved, victim, tmp_path, fname) -> None:
    """The link's target has the very bytes the index records: only where it lives is wrong."""
    ckpt, out = _layout(saved, tmp_path)
    outside = tmp_path / "elsewhere"
    outside.write_bytes((ckpt / fname).read_bytes())
    (ckpt / fname).unlink()
    (ckpt / fname).symlink_to(outside)
    index = json.loads((ckpt / INDEX_NAME).read_text())
    _refused_everywhere(victim, ckpt, out, index, "symlink", tmp_path)
    assert outside.read_bytes() == (saved / fname).read_bytes()


def test_a_symlink_inside_the_folder_is_followed(saved, tmp_path) -> None:
    """The check is about where a name leads, not about links: a link to a file of the
    folder loads and exports (the export holds a copy, not a link)."""
    ckpt, out = _layout(saved, tmp_path)
    (ckpt / "config.json").rename(ckpt / "config.real")
    (ckpt / "config.json").symlink_to("config.real")
    run = Run(0, 1, seed=4)
    ck.load(run.emodel, run.eopt, ckpt, scheduler=run.sched)
    ck.export(ckpt, out)
    assert not (out / "config.json").is_symlink()
    assert (out / "config.json").read_bytes() == (saved / "config.json").read_bytes()


def _same_size_edit(path: Path) -> None:
    """Change one digit of a number in a JSON file: the size stays, the JSON stays valid."""
    text = path.read_text()
    at = next(i for i, c in enumerate(text) if c in "123456789" and text[i - 1] in " .0123456789")
    path.write_text(text[:at] + ("2" if text[at] != "2" else "3") + text[at + 1:])
    json.loads(path.read_text())


@pytest.mark.parametrize("fname", ["scheduler.json", "optimizer_state.json", "extra.json"])
def test_a_same_size_edit_of_a_json_file_is_refused_on_load(saved, victim, tmp_path, fname) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    size = (ckpt / fname).stat().st_size
    _same_size_edit(ckpt / fname)
    assert (ckpt / fname).stat().st_size == size and (ckpt / fname).read_bytes() != (saved / fname).read_bytes()
    before = victim.local_state()
    sched_before = victim.sched.state_dict()
    with pytest.raises(ck.CheckpointError) as exc:
        ck.load(victim.emodel, victim.eopt, ckpt, scheduler=victim.sched)
    assert str(ckpt / fname) in str(exc.value) and "sha256" in str(exc.value), str(exc.value)
    assert_same_local_state(before, victim.local_state())
    assert victim.sched.state_dict() == sched_before


# ---------------------------------------------------------------------- one rank's unexpected error
PG_TIMEOUT = timedelta(seconds=30)  # a hang ends as a timeout error, which the tests tell apart


class _BrokenTokenizer:
    def save_pretrained(self, folder: str) -> None:
        raise ValueError("injected: the tokenizer cannot be saved")


def _outcome(fn) -> dict:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test inspects whatever each rank raised
        return {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    return {"type": None}


def _short_timeout(run: Run) -> None:
    """The checkpoint's collectives go over a group with a short timeout."""
    run.emodel.comm.gather_group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)


def _save_with_error_on_rank0(rank: int, world_size: int, base: str) -> dict:
    run = Run(rank, world_size)
    _short_timeout(run)
    previous = Path(base) / "ckpt"
    ck.save(run.emodel, run.eopt, previous, extra={"step": 0})
    extra = {"tokenizer": _BrokenTokenizer()} if rank == 0 else {}
    got = _outcome(lambda: ck.save(run.emodel, run.eopt, previous, extra=extra))
    dist.barrier(group=run.emodel.comm.gather_group)
    got["leftovers"] = sorted(p.name for p in Path(base).iterdir())
    got["loads"] = _outcome(lambda: ck.load(run.emodel, run.eopt, previous))
    return got


def test_an_error_of_any_type_in_save_reaches_every_rank(tmp_path) -> None:
    ranks = run_distributed(_save_with_error_on_rank0, 2, str(tmp_path), timeout=180)
    failing, other = ranks
    assert failing["type"] == "ValueError" and "injected" in failing["message"]
    assert "save_pretrained" in failing["traceback"]       # its own traceback, from where it failed
    assert other["type"] == "CheckpointError", other
    assert "reported by rank 0" in other["message"] and "ValueError" in other["message"]
    assert "injected" in other["message"] and "unchanged" in other["message"]
    for r in ranks:  # the temporary folder is gone and the previous checkpoint still loads
        assert r["leftovers"] == ["ckpt"] and r["loads"]["type"] is None, r


def _load_with_bad_index_on_rank1(rank: int, world_size: int, base: str) -> dict:
    load_module = importlib.import_module("hf_elixir.checkpoint.load")  # the package's `load` is the function

    run = Run(rank, world_size)
    _short_timeout(run)
    ck.save(run.emodel, run.eopt, Path(base) / "ckpt")
    if rank == 1:  # this rank reads a malformed index: a parameter without its slices
        resolve = load_module.resolve

        def malformed(directory):
            path, index = resolve(directory)
            del index["params"][0]["slices"]
            return path, index
        load_module.resolve = malformed
    run.steps(1)
    before = run.local_state()
    got = _outcome(lambda: ck.load(run.emodel, run.eopt, Path(base) / "ckpt"))
    assert_same_local_state(before, run.local_state())
    return got


def test_an_error_of_any_type_in_load_reaches_every_rank(tmp_path) -> None:
    other, failing = run_distributed(_load_with_bad_index_on_rank1, 2, str(tmp_path), timeout=180)
    assert failing["type"] == "KeyError" and "slices" in failing["message"]
    assert "_check_model" in failing["traceback"]
    assert other["type"] == "CheckpointError", other
    assert "reported by rank 1" in other["message"] and "KeyError" in other["message"]
