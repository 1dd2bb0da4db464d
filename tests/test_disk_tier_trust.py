"""The disk tier on a shared scratch disk (issue 60, finding 5).

- Rank folders carry the user's number and are private: one that is a symlink or that others
  can write is refused, and nothing it holds or points at is touched.
- A lock file another user owns, or one this user cannot open, is refused naming its owner;
  a second run on the same ``nvme_path`` is refused naming the first (pid, host, user).
- A full disk or an I/O error on an I/O thread is a ``DiskTierError``; a plane whose write
  failed never counts as written, and the tier refuses every use after it.
- SIGTERM removes the run's files, and the process still dies of it.
- ``O_DIRECT`` is probed at open: a file system that takes the flag but refuses its
  transfers is used through the page cache, with a warning, instead of failing mid-step.

The tiers here are opened directly (``DiskPlan.open``) with one small chunk; the training
path is checked once, at world size 1, for the error a full disk gives there.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import re

import pytest
import torch

from hf_elixir.runtime.disk_tier import DATA_NAME, DIR_PREFIX, GRAD, LOCK_NAME, DiskChunk, DiskPlan, DiskTierError
from hf_elixir.runtime.private_dir import owner_name

NUMEL = 1024


def _open(root: Path):
    return DiskPlan(root, [DiskChunk(0, NUMEL, 0, ("state0", "state1", GRAD))]).open(0)


def _victim(tmp_path: Path) -> Path:
    """A folder of the user's that a planted link points at: nothing in it may go."""
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    (victim / "data").mkdir()
    (victim / "data" / "run.csv").write_text("1,2,3")
    return victim


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---------------------------------------------------------------------- rank folders
def test_rank_folders_carry_the_user_and_only_the_user_can_enter_them(tmp_path) -> None:
    tier = _open(tmp_path)
    try:
        assert tier.directory.name == f"hf_elixir-{os.getuid()}-rank00000"
        assert (tier.directory.stat().st_mode & 0o777) == 0o700
    finally:
        tier.close()
    assert list(tmp_path.iterdir()) == []


def test_a_symlinked_rank_folder_is_refused_and_its_target_untouched(tmp_path) -> None:
    victim = _victim(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / f"{DIR_PREFIX}00000").symlink_to(victim)
    before = _files(victim)
    with pytest.raises(DiskTierError, match=r"is a symlink .*Nothing in it was read or removed"):
        _open(scratch)
    assert _files(victim) == before
    assert (victim / "thesis.tex").read_text() == "years of work"


def test_a_rank_folder_others_can_write_is_refused_and_left_as_it_is(tmp_path) -> None:
    folder = tmp_path / f"{DIR_PREFIX}00000"
    folder.mkdir()
    folder.chmod(0o777)
    (folder / "someone_elses.bin").write_bytes(b"x" * 10)
    with pytest.raises(DiskTierError, match=r"writable by others \(mode 777\).*chmod go-w"):
        _open(tmp_path)
    assert _files(folder) == ["someone_elses.bin"]


def _lock_owned_by(uid: int, monkeypatch) -> None:
    """Make the kernel report ``uid`` as the owner of any open lock file (``os.fstat``)."""
    real = os.fstat

    def fstat(fd: int):
        info = real(fd)
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/" + LOCK_NAME):
            fields = list(info)
            fields[4] = uid  # st_uid
            return os.stat_result(fields)
        return info

    monkeypatch.setattr(os, "fstat", fstat)


def test_a_lock_file_another_user_owns_is_refused_naming_the_owner(tmp_path, monkeypatch) -> None:
    folder = tmp_path / f"{DIR_PREFIX}00000"
    folder.mkdir(mode=0o700)
    (folder / LOCK_NAME).write_text('{"pid": 4242, "host": "elsewhere"}')
    (folder / DATA_NAME).write_bytes(b"theirs")
    other = 65534 if os.getuid() != 65534 else 65533
    _lock_owned_by(other, monkeypatch)
    with pytest.raises(DiskTierError, match=rf"belongs to {re.escape(owner_name(other))}.*, not to you.*"
                                            r"left by pid 4242 on host elsewhere.*its own nvme_path"):
        _open(tmp_path)
    assert (folder / DATA_NAME).read_bytes() == b"theirs"


def test_a_lock_file_this_user_cannot_open_is_refused_naming_its_owner(tmp_path, monkeypatch) -> None:
    real = os.open

    def refusing(path, flags, *args, **kwargs):
        if os.fspath(path).endswith(LOCK_NAME):  # as for another user's 0644 file
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path, flags, *args, **kwargs)

    folder = tmp_path / f"{DIR_PREFIX}00000"
    folder.mkdir(mode=0o700)
    (folder / LOCK_NAME).write_text("{}")
    monkeypatch.setattr(os, "open", refusing)
    me = re.escape(owner_name(os.getuid()))
    with pytest.raises(DiskTierError, match=rf"{LOCK_NAME} belongs to {me} and this user cannot open it.*nvme_path"):
        _open(tmp_path)


# ---------------------------------------------------------------------- another process
_HOLDER = """
import sys, time
from pathlib import Path
from hf_elixir.runtime.disk_tier import GRAD, DiskChunk, DiskPlan
tier = DiskPlan(Path(sys.argv[1]), [DiskChunk(0, 1024, 0, ("state0", "state1", GRAD))]).open(0)
print(tier.directory, flush=True)
time.sleep(300)
"""


def _holder(root: Path) -> tuple[subprocess.Popen, Path]:
    """A process that opened a tier in ``root`` and holds it; and the tier's folder."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 180)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        proc.kill()
        raise AssertionError(f"the holder did not open its tier (exit code {proc.poll()})")
    return proc, Path(line)


def test_a_second_run_on_the_same_path_is_refused_naming_the_first(tmp_path) -> None:
    proc, folder = _holder(tmp_path)
    try:
        first = rf"pid {proc.pid} on host {re.escape(socket.gethostname())}, user {re.escape(owner_name(os.getuid()))}"
        with pytest.raises(DiskTierError, match=rf"in use by another live run \({first}.*its own nvme_path"):
            _open(tmp_path)
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME, DATA_NAME]  # the first's, untouched
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_removes_the_files_and_the_process_still_dies_of_it(tmp_path) -> None:
    proc, folder = _holder(tmp_path)
    try:
        assert folder.is_dir()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert not folder.exists() and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- I/O errors
def _failing(code: int):
    """An ``os.pwritev``/``os.preadv`` that fails as a disk would, with ``code``."""
    def call(fd, buffers, offset):
        raise OSError(code, os.strerror(code))
    return call


def test_a_full_disk_on_write_back_is_a_disk_tier_error_and_nothing_counts_as_written(tmp_path, monkeypatch) -> None:
    tier = _open(tmp_path)
    try:
        tier.set_state_names(["exp_avg", "exp_avg_sq"])
        monkeypatch.setattr(os, "pwritev", _failing(errno.ENOSPC))
        with tier.opened(0, write=True) as views:
            views["exp_avg"].fill_(3.0)
        with pytest.raises(DiskTierError, match=r"could not write .* the disk is full \(ENOSPC.*resume from the "
                                                r"last checkpoint"):
            tier.flush()
        assert not tier._written  # the state planes were never written: they read as zeros
        with pytest.raises(DiskTierError, match="the disk is full"):  # and every later use refuses
            tier.acquire(0)
        with pytest.raises(DiskTierError, match="the disk is full"):
            tier.grads.open(0)
    finally:
        monkeypatch.undo()
        tier.close()
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_on_a_gradient_write_back_leaves_no_gradient_stored(tmp_path, monkeypatch) -> None:
    tier = _open(tmp_path)
    try:
        monkeypatch.setattr(os, "pwritev", _failing(errno.ENOSPC))
        tier.grads.open(0).fill_(1.0)
        tier.grads.close(0)
        with pytest.raises(DiskTierError, match=r"could not write .* the disk is full"):
            tier.grads.settle()
        assert not tier.grads.stored(0)  # never reads back as a gradient the file does not hold
    finally:
        monkeypatch.undo()
        tier.close()


def test_an_io_error_on_read_is_a_disk_tier_error(tmp_path, monkeypatch) -> None:
    tier = _open(tmp_path)
    try:
        tier.set_state_names(["exp_avg", "exp_avg_sq"])
        with tier.opened(0, write=True) as views:
            views["exp_avg"].fill_(3.0)
        tier.flush()
        for buf in tier._ring:  # nothing cached: the next acquire reads the file
            buf.cid = None
        monkeypatch.setattr(os, "preadv", _failing(errno.EIO))
        with pytest.raises(DiskTierError, match=r"could not read .* the disk reported an I/O error \(EIO"):
            tier.acquire(0)
    finally:
        monkeypatch.undo()
        tier.close()


def _train_on_a_full_disk(rank: int, world_size: int, nvme: str) -> dict:
    from test_disk_tier import _batches, _model, _plan, _run

    import hf_elixir as hfe

    model = _model(64, 4)
    emodel = hfe.ElixirModule(model, _plan(model, 1, 64 * 64, True), nvme_path=nvme)
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-2))
    emodel.disk.flush()  # what set-up wrote is in the file: from here every write fails
    real = os.pwritev
    os.pwritev = _failing(errno.ENOSPC)
    try:
        _run(emodel, opt, _batches(0, 2))
        error = None
    except Exception as exc:  # noqa: BLE001 - what the user sees is the point
        error = exc
    finally:
        os.pwritev = real
    emodel.close()
    return {"type": type(error).__name__, "message": str(error), "left": sorted(os.listdir(nvme))}


def test_training_on_a_full_disk_stops_with_a_disk_tier_error(tmp_path) -> None:
    from harness import run_distributed

    out = run_distributed(_train_on_a_full_disk, 1, str(tmp_path))[0]
    assert out["type"] == "DiskTierError", out
    assert "the disk is full" in out["message"] and "resume from the last checkpoint" in out["message"]
    assert out["left"] == []


# ---------------------------------------------------------------------- O_DIRECT
def test_o_direct_refused_by_the_file_system_is_found_at_open_and_falls_back(tmp_path, monkeypatch) -> None:
    """A file system that accepts the O_DIRECT flag at open but refuses its transfers
    (EINVAL): the tier finds it when it opens, warns, and works through the page cache."""
    real_open, real_pwritev, real_preadv = os.open, os.pwritev, os.preadv
    direct: set[int] = set()

    def open_(path, flags, *args, **kwargs):
        fd = real_open(path, flags & ~os.O_DIRECT, *args, **kwargs)
        (direct.add if flags & os.O_DIRECT else direct.discard)(fd)
        return fd

    def refusing(real):
        def call(fd, buffers, offset):
            if fd in direct:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return real(fd, buffers, offset)
        return call

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "pwritev", refusing(real_pwritev))
    monkeypatch.setattr(os, "preadv", refusing(real_preadv))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tier = _open(tmp_path)
    try:
        assert any("accepts O_DIRECT but refused" in str(w.message) and "page cache" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
        assert tier.direct is False and tier.file.direct is False
        tier.set_state_names(["exp_avg", "exp_avg_sq"])
        with tier.opened(0, write=True) as views:
            views["exp_avg"].copy_(torch.arange(NUMEL, dtype=torch.float32))
        tier.flush()
        for buf in tier._ring:
            buf.cid = None
        with tier.opened(0) as views:
            assert torch.equal(views["exp_avg"], torch.arange(NUMEL, dtype=torch.float32))
            assert torch.equal(views["exp_avg_sq"], torch.zeros(NUMEL))
    finally:
        monkeypatch.undo()
        tier.close()
