"""File names in a checkpoint: each must name a file inside the checkpoint's folder.

An index is data read from disk. A crafted or damaged one could list ``../../.bashrc``, an
absolute path, or a symlink placed in the folder that points elsewhere; a reader that joined
such a name to the folder would read, hash or (export) copy a file outside the checkpoint,
and export would write its copy where the name points. So every name the index hands to a
reader (``files``, ``rank_files``, ``hf_files``) and every name ``save`` is given
(``extra["files"]``) passes one check, ``member``, before it is joined to a folder, and
``check_index_names`` runs it over a whole index before anything is read or written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_elixir.checkpoint.errors import CheckpointError

_SEPARATORS = ("/", "\\", "\x00")


def plain_name(name: Any, where: str) -> str:
    """``name`` if it is a plain file name: a non-empty string with no path separator, NUL
    or drive, and neither ``.`` nor ``..`` (``Path(name).name == name`` alone lets ``..``
    and the empty string through)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or any(s in name for s in _SEPARATORS)
            or Path(name).name != name):
        raise CheckpointError(
            f"{where}: {name!r} is not a plain file name inside the checkpoint folder (no '/', no '..'); "
            "the checkpoint was damaged or crafted: do not use it, load an earlier checkpoint or save again")
    return name


def member(folder: Path, name: Any, where: str) -> Path:
    """``folder / name`` once ``name`` is a plain name and the path, with symlinks resolved,
    stays inside ``folder`` (a symlink to a file in the folder is accepted; one pointing
    anywhere else is refused, so no reader follows it out)."""
    path = Path(folder) / plain_name(name, where)
    if path.is_symlink():
        target = path.resolve()
        base = Path(folder).resolve()
        if target == base or not target.is_relative_to(base):
            raise CheckpointError(
                f"{where}: {path} is a symlink to {target}, outside the checkpoint folder {base}; refusing "
                "to follow it: replace the link with the file itself, or load an earlier checkpoint")
    return path


def check_index_names(folder: Path, index: dict, where: str) -> None:
    """Every file name ``index`` lists (``files``, ``rank_files``, ``hf_files``) is a member of
    ``folder``, and the names read through ``rank_files`` and ``hf_files`` are listed in
    ``files`` (so their sizes and hashes are checked like the others')."""
    files = index.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{where}: 'files' is not a mapping of file names; the index is corrupted")
    for name, info in files.items():
        member(folder, name, f"{where}: files")
        if not (isinstance(info, dict) and isinstance(info.get("size"), int) and isinstance(info.get("sha256"), str)):
            raise CheckpointError(f"{where}: files[{name!r}] has no integer 'size' and string 'sha256'; "
                                  "the index is corrupted")
    rank_files = index.get("rank_files")
    if not isinstance(rank_files, list) or len(rank_files) != index.get("world_size"):
        raise CheckpointError(f"{where}: 'rank_files' is not a list of one entry per rank (world_size "
                              f"{index.get('world_size')!r}); the index is corrupted")
    for rank, entry in enumerate(rank_files):
        if not isinstance(entry, dict) or "model" not in entry:
            raise CheckpointError(f"{where}: rank_files[{rank}] has no 'model' file; the index is corrupted")
        for kind in ("model", "optimizer"):
            name = entry.get(kind)
            if name is None and kind == "optimizer":
                continue
            _listed(folder, files, name, f"{where}: rank_files[{rank}][{kind!r}]")
    hf_files = index.get("hf_files", [])
    if not isinstance(hf_files, list):
        raise CheckpointError(f"{where}: 'hf_files' is not a list of file names; the index is corrupted")
    for i, name in enumerate(hf_files):
        _listed(folder, files, name, f"{where}: hf_files[{i}]")


def _listed(folder: Path, files: dict, name: Any, where: str) -> None:
    member(folder, name, where)
    if name not in files:
        raise CheckpointError(f"{where}: {name!r} is not listed in the index's 'files' (no size or sha256 "
                              "to check it against); the index is corrupted")
