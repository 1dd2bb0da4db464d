"""The checkpoint's index: names, format version, validation and finding the checkpoint.

``elixir_index.json`` is written last, by rank 0, after every rank's files are complete and
synced, and it lists every file with its size and sha256. A directory is a checkpoint only
if its index is there, parses, has a format version this code understands, and every file
it lists exists with the recorded size (and, when read, the recorded hash), and every file
name it lists is a plain name inside the directory (``names.py``): a crafted index cannot make
a reader touch a file elsewhere.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from hf_elixir.checkpoint.atomic import OLD_MARK, TMP_MARK, leftovers
from hf_elixir.checkpoint.errors import CheckpointError
from hf_elixir.checkpoint.io import file_sha256
from hf_elixir.checkpoint.names import check_index_names, member

FORMAT = "hf_elixir.sharded_checkpoint"
FORMAT_VERSION = 2          # the newest format this code reads and writes
# Checkpoints of models without frozen parameters are written as version 1, unchanged, so
# an older hf_elixir still reads them; version 2 adds the index's ``frozen`` entry (frozen
# weights recorded by digest, not stored), which an older reader must refuse, not misread.
PLAIN_FORMAT_VERSION = 1
INDEX_NAME = "elixir_index.json"
OPTIMIZER_STATE_NAME = "optimizer_state.json"
SCHEDULER_NAME = "scheduler.json"
EXTRA_NAME = "extra.json"
UNTRACKED_NAME = "model-untracked.safetensors"
HF_FILES = ("config.json", "generation_config.json")


def model_file(rank: int, world_size: int) -> str:
    return f"model-rank-{rank:05d}-of-{world_size:05d}.safetensors"


def optimizer_file(rank: int, world_size: int) -> str:
    return f"optimizer-rank-{rank:05d}-of-{world_size:05d}.safetensors"


def read_index(directory: Path) -> dict[str, Any]:
    """Read and check ``directory``'s index and that every listed file has its recorded size."""
    directory = Path(directory)
    path = directory / INDEX_NAME
    if not path.is_file():
        raise CheckpointError(_not_a_checkpoint(directory))
    try:
        index = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the index is not valid JSON ({e}); the checkpoint is corrupted") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an hf_elixir checkpoint index (no 'format': {FORMAT!r})")
    version = index.get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"{path}: the index has no integer 'format_version'")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {version} is newer than this hf_elixir reads "
            f"(up to {FORMAT_VERSION}); upgrade hf_elixir to load it"
        )
    for key in ("world_size", "params", "files", "rank_files"):
        if key not in index:
            raise CheckpointError(f"{path}: the index has no {key!r}; the checkpoint is corrupted")
    check_index_names(directory, index, str(path))  # before any name is joined to the folder
    for name, info in index["files"].items():
        fpath = member(directory, name, str(path))
        if not fpath.is_file():
            raise CheckpointError(
                f"{fpath}: file listed in the index is missing; the checkpoint is incomplete "
                "(copy the missing file back, or load an earlier checkpoint)"
            )
        size = fpath.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"{fpath}: {size} bytes, the index records {info['size']}; the file is truncated or "
                "was replaced"
            )
    return index


def verify_hashes(directory: Path, index: dict[str, Any], names) -> None:
    """Check the sha256 of the listed files (all of them for ``names=None``)."""
    for name in (index["files"] if names is None else names):
        info = index["files"][name]
        fpath = member(Path(directory), name, str(Path(directory) / INDEX_NAME))
        if file_sha256(fpath) != info["sha256"]:
            raise CheckpointError(
                f"{fpath}: contents do not match the sha256 recorded in the index; the file is corrupted"
            )


def _not_a_checkpoint(directory: Path) -> str:
    if not directory.exists():
        return f"{directory}: no such directory; nothing was saved there"
    if not directory.is_dir():
        return f"{directory}: not a directory; pass the checkpoint directory that save() wrote"
    hint = ""
    if (directory / "config.json").exists() and any(directory.glob("*.safetensors")):
        hint = " (it looks like a Hugging Face model folder: load it with from_pretrained instead)"
    return f"{directory}: not an hf_elixir checkpoint, it has no {INDEX_NAME}{hint}"


def resolve(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    """The complete checkpoint stored under ``directory`` and its index.

    ``directory`` itself if it holds a checkpoint. If an interrupted save left it missing
    (killed between its two renames), the previous checkpoint is in ``<dir>.old-*``: use it.
    A ``<dir>.tmp-*`` is never used: it may be incomplete; it is only reported.
    """
    directory = Path(directory)
    if (directory / INDEX_NAME).exists():
        return directory, read_index(directory)
    for backup in leftovers(directory, OLD_MARK):
        try:
            index = read_index(backup)
        except CheckpointError:
            continue
        warnings.warn(
            f"{directory} is missing: a save was interrupted while replacing it; using the previous "
            f"checkpoint {backup} (the next save to {directory} finishes the cleanup)",
            stacklevel=3,
        )
        return backup, index
    message = _not_a_checkpoint(directory)
    partial = leftovers(directory, TMP_MARK)
    if partial:
        message += (f"; an interrupted save left the incomplete {partial[0].name} beside it, which is "
                    "ignored (delete it, or save again)")
    raise CheckpointError(message)
