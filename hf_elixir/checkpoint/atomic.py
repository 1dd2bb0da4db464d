"""Atomic directory replacement and fault injection for the saver.

A save writes everything under ``<name>.tmp-<nonce>`` beside the target, fsyncs each
file and the directory, and then commits with two renames::

    <name>            -> <name>.old-<nonce>      (only if a previous checkpoint exists)
    <name>.tmp-<nonce> -> <name>                  (the commit point)
    rm -r <name>.old-<nonce>

POSIX cannot rename a directory over a non-empty one, hence the backup. At every instant
one complete checkpoint can be found: ``<name>`` if it is valid, else the backup (the
previous checkpoint, between the two renames). ``resolve`` in index.py implements that
rule; a ``.tmp-`` directory is never loaded.

Fault injection: with ``HF_ELIXIR_CKPT_FAULT_AT=k`` in the environment (and optionally
``HF_ELIXIR_CKPT_FAULT_RANK=r``), the saver SIGKILLs its own process just before its k-th
write, fsync, rename or delete (1-based), so tests can stop a real save anywhere.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Optional

FAULT_ENV = "HF_ELIXIR_CKPT_FAULT_AT"
FAULT_RANK_ENV = "HF_ELIXIR_CKPT_FAULT_RANK"
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


class FaultInjector:
    """Counts the saver's durable operations; kills the process at the chosen one."""

    def __init__(self, kill_at: Optional[int] = None) -> None:
        self.kill_at = kill_at
        self.labels: list[str] = []

    @classmethod
    def from_env(cls, rank: int) -> "FaultInjector":
        at = os.environ.get(FAULT_ENV)
        want_rank = os.environ.get(FAULT_RANK_ENV)
        if not at or (want_rank is not None and int(want_rank) != rank):
            return cls(None)
        return cls(int(at))

    def __call__(self, label: str) -> None:
        self.labels.append(label)
        if self.kill_at is not None and len(self.labels) == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(final: Path, nonce: str) -> Path:
    return final.parent / f"{final.name}{TMP_MARK}{nonce}"


def old_name(final: Path, nonce: str) -> Path:
    return final.parent / f"{final.name}{OLD_MARK}{nonce}"


def leftovers(final: Path, mark: str) -> list[Path]:
    """Siblings ``<name><mark>*`` left by interrupted saves, newest first."""
    if not final.parent.is_dir():
        return []
    prefix = final.name + mark
    found = [p for p in final.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def commit(tmp: Path, final: Path, nonce: str, fault: FaultInjector) -> None:
    """Swap ``tmp`` in for ``final`` (see the module docstring); ``tmp`` is complete and synced."""
    parent = final.parent
    backup = old_name(final, nonce)
    had_old = final.exists()
    if had_old:
        fault(f"rename {final.name} -> {backup.name}")
        os.rename(final, backup)
        fault(f"fsync {parent}")
        fsync_dir(parent)
    fault(f"rename {tmp.name} -> {final.name}")
    os.rename(tmp, final)
    fault(f"fsync {parent}")
    fsync_dir(parent)
    if had_old:
        fault(f"delete {backup.name}")
        shutil.rmtree(backup, ignore_errors=True)
