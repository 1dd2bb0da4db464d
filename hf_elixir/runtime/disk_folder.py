"""The disk tier's rank folder: claimed for one run, emptied, and removed, on a shared disk.

``nvme_path`` is often a scratch disk other users write too. Each rank works in
``<nvme_path>/hf_elixir-<uid>-rank<r>/``: the user's number in the name, so users sharing
the disk never meet, and a folder only this user can write (``private_dir.open_private``:
mode 0700; one that is a symlink, another user's, or writable by others is refused, and
nothing in it is read or removed). Everything after that check is done through the folder's
descriptor (``dir_fd=``), never through a path that could since have been swapped for a
symlink, and a symlink inside is removed, never followed.

The rank claims the folder with a lock file (``flock``) holding the run's identity (pid,
host, user, start): a folder another live run holds is refused naming that run; a lock file
another user owns, or one this user cannot open, is refused naming its owner; a folder left
by a run that crashed is emptied with a warning.

The files go when the tier closes, at exit, when it is collected, and on SIGTERM
(``_on_sigterm``): torchrun sends SIGTERM to the surviving workers when one fails, and its
default action ends a process without running exit handlers. Never in a forked child,
which shares the parent's files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import stat
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hf_elixir.runtime.disk_io import DiskTierError
from hf_elixir.runtime.private_dir import UntrustedFolderError, open_private, owner_name

ENV = "ELIXIR_NVME_PATH"
#: a rank folder's name before its rank: the user's number in it, so that users sharing
#: one scratch disk each have their own folders (and never claim or empty another's)
DIR_PREFIX = f"hf_elixir-{os.getuid()}-rank"
LOCK_NAME = "owner.lock"
DATA_NAME = "state.bin"
RANK_FOLDER = "the disk tier's rank folder"


def _identity() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "user": owner_name(os.getuid()),
            "run": uuid.uuid4().hex, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def describe(owner: str) -> str:
    """A lock file's identity as a message names it ("pid 12 on host a, user b ...")."""
    try:
        who = json.loads(owner)
    except ValueError:
        who = None
    if not isinstance(who, dict):
        return owner or "no identity recorded"
    host = f" on host {who['host']}" if "host" in who else ""
    rest = ", ".join(f"{k} {who[k]}" for k in ("user", "run", "started") if k in who)
    return f"pid {who.get('pid', '?')}{host}" + (f", {rest}" if rest else "")


def _lock(directory: Path, dfd: int) -> int:
    """The rank folder's lock file, opened (never through a symlink) and this user's own;
    another user's, or one this user cannot open, is refused naming its owner."""
    path = directory / LOCK_NAME
    try:
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DiskTierError(f"{path} is a symlink; hf_elixir does not follow it. Remove it, or give this "
                                "run its own nvme_path") from None
        if e.errno not in (errno.EACCES, errno.EPERM):
            raise
        uid = os.stat(LOCK_NAME, dir_fd=dfd, follow_symlinks=False).st_uid
        raise DiskTierError(f"{path} belongs to {owner_name(uid)} and this user cannot open it: another "
                            f"user's run claimed this folder; give this run its own nvme_path (or {ENV}), "
                            "or have that user remove the file") from None
    uid = os.fstat(fd).st_uid
    if uid != os.getuid():
        held = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        raise DiskTierError(f"{path} belongs to {owner_name(uid)}, not to you ({owner_name(os.getuid())}); "
                            f"it was left by {describe(held)}. hf_elixir takes over only its own user's "
                            f"folders: give this run its own nvme_path (or {ENV}), or have that user remove it")
    return fd


def _delete(dfd: int, name: str) -> None:
    """Remove ``name`` from the folder open as ``dfd``; a symlink is removed, never followed."""
    info = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def _refuse_held(directory: Path, owner: str) -> DiskTierError:
    pid = None
    with contextlib.suppress(ValueError, AttributeError):
        pid = json.loads(owner).get("pid")
    if pid == os.getpid():
        return DiskTierError(f"{directory} is held by another ElixirModule of this process ({describe(owner)}); "
                             "close() it first, or give this one its own nvme_path")
    return DiskTierError(f"{directory} is in use by another live run ({describe(owner)}); give each run its own "
                         f"nvme_path (or {ENV})")


@dataclass(eq=False)
class RankFolder:
    """A rank's claimed folder: its path, the descriptors of the folder and of the files
    in it (the lock's first), and the process that claimed it (the only one that removes it)."""

    directory: Path
    dfd: int
    fds: list[int] = field(default_factory=list)
    pid: int = field(default_factory=os.getpid)

    def remove_files(self) -> None:
        """Remove the files and the folder, through the folder's descriptor; the descriptors
        stay open (I/O may still be in flight: SIGTERM does not wait for it)."""
        if os.getpid() != self.pid or not self.fds:
            return
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dfd):
                with contextlib.suppress(OSError):
                    _delete(self.dfd, name)
            os.rmdir(self.directory)  # only if it is still that folder, now empty

    def remove(self) -> None:
        """Remove the files and the folder, then close the descriptors. Idempotent."""
        _LIVE.discard(self)
        self.remove_files()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def claim(root: Path, rank: int) -> RankFolder:
    """Lock this rank's folder for this run and empty it (see the module docstring); its
    files are removed on SIGTERM from now on. Raises ``DiskTierError`` before anything in
    a refused folder is touched."""
    directory = root / f"{DIR_PREFIX}{rank:05d}"
    try:
        dfd = open_private(directory, RANK_FOLDER)
    except UntrustedFolderError as e:
        raise DiskTierError(f"{e}. Nothing in it was read or removed") from None
    fds = [dfd]
    try:
        fd = _lock(directory, dfd)
        fds.insert(0, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _refuse_held(directory, os.pread(fd, 4096, 0).decode(errors="replace").strip()) from None
        stale = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        for name in os.listdir(dfd):
            if name != LOCK_NAME:
                _delete(dfd, name)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_identity()).encode(), 0)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    if stale:
        warnings.warn(f"hf_elixir: {directory} held the scratch files of a run that did not exit cleanly "
                      f"({describe(stale)}); they were discarded unread, and this run writes its own state "
                      "there", stacklevel=4)
    folder = RankFolder(directory, dfd, fds)
    _LIVE.add(folder)
    _install_sigterm()
    return folder


# ---------------------------------------------------------------------- SIGTERM
#: the claimed folders of this process, whose files SIGTERM removes
_LIVE: set[RankFolder] = set()
#: SIGTERM's handler before ``_on_sigterm`` (None: not installed)
_previous_sigterm: Optional[object] = None


def _install_sigterm() -> None:
    """Handle SIGTERM (``_on_sigterm``), once. Only from the main thread (Python runs its
    signal handlers there); never over an ignored SIGTERM or a handler installed from C
    (``getsignal`` says None), which hf_elixir cannot chain."""
    global _previous_sigterm
    if _previous_sigterm is not None or threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is None or current == signal.SIG_IGN or current is _on_sigterm:
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _previous_sigterm = current


def _on_sigterm(signum: int, frame) -> None:
    """A handler installed before this one runs as it would have: if the process goes on (it
    chose to, e.g. to save a checkpoint first), the files stay until the tier closes or the
    process exits (where they go, as at any exit). Under the default action the files are
    removed, then the process dies of the signal, as it would have.

    Python runs the handler when the main thread next runs Python code: a main thread stuck
    in a collective gets to it once that returns (gloo's fails when a peer is gone)."""
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    for folder in list(_LIVE):
        folder.remove_files()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
