"""Folders only this user can write: the kernel cache and the disk tier's rank folders.

Both live under paths another user may share (``~/.cache`` on a shared home, a scratch disk
named by ``nvme_path``). Whatever hf_elixir loads or deletes there must be this user's own: a
folder that is a symlink, owned by another user, or writable by the group or the world could
have been planted or redirected, so it is refused before anything in it is read, loaded or
removed.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..vocab import HfElixirError

#: group or world write: anyone but the owner could plant or swap files in the folder
_FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UntrustedFolderError(HfElixirError, PermissionError):
    """A folder hf_elixir would load from or delete in is not this user's private folder."""


def owner_name(uid: int) -> str:
    """``uid`` as a message names it: the user name and the number (the number alone where
    the system has no name for it)."""
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


_owner_name = owner_name  # the name other modules used before it was public


def check_private(path: Path, what: str) -> os.stat_result:
    """Refuse ``path`` unless it is a real folder (not a symlink), owned by this user, and not
    writable by the group or the world; return its ``lstat``. ``what`` names the folder in the
    message ("the kernel cache", "the disk tier's rank folder")."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise UntrustedFolderError(f"{what} {str(path)!r} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedFolderError(
            f"{what} {str(path)!r} is a symlink (to {os.readlink(path)!r}); hf_elixir does not follow it. "
            "Remove the link, or point hf_elixir at a folder of your own") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedFolderError(f"{what} {str(path)!r} is not a folder; remove it or choose another path")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise UntrustedFolderError(
            f"{what} {str(path)!r} belongs to {_owner_name(info.st_uid)}, not to you "
            f"({_owner_name(os.getuid())}); choose a path of your own")
    if info.st_mode & _FOREIGN_WRITE:
        raise UntrustedFolderError(
            f"{what} {str(path)!r} is writable by others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"run `chmod go-w {path}` or choose a folder only you can write")
    return info


def private_directory(path: Path, what: str, parents: bool = True) -> Path:
    """Make ``path`` (mode 0700) if it is missing, then :func:`check_private` it. A folder
    made by another process between the two steps is checked like any other."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise
    check_private(path, what)
    return path


def open_private(path: Path, what: str) -> int:
    """:func:`private_directory`, then the folder opened (``O_DIRECTORY | O_NOFOLLOW``) and
    its descriptor checked to be the folder just checked; returns the descriptor.

    What a caller then does relative to it (``dir_fd=``) happens in that folder even if the
    path is swapped for a symlink after the check: a parent folder others can write (a
    scratch disk without the sticky bit) cannot redirect a deletion."""
    checked = check_private(private_directory(path, what, parents=False), what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise UntrustedFolderError(f"{what} {str(path)!r} changed while it was checked ({exc.strerror or exc}); "
                                   "choose a folder only you can write") from None
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
        os.close(fd)
        raise UntrustedFolderError(f"{what} {str(path)!r} was replaced while it was checked; "
                                   "choose a folder only you can write")
    return fd
