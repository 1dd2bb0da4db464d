"""Consolidate a sharded checkpoint into a folder ``from_pretrained`` loads.

One process, no GPU, no process group. Tensors are assembled one at a time from the saved
slices (read with ``pread``, no memory map) and written straight into the output file, whose
header is computed up front from the index; memory therefore stays at about one tensor
(two when casting), far below one output shard.

A checkpoint of a model with frozen parameters (a PEFT base, frozen embeddings) does not
hold them (``save.py``), so it cannot be turned into a full model on its own, and export
refuses it with what to do instead. Rebuilding the frozen part from some other folder would
need that folder's key names mapped onto the wrapped model's (PEFT renames every base
weight) and could silently pair the adapters with the wrong base; the run that has the
model already has the right base and the right names: load the checkpoint there and save
with ``accelerator.save_model`` / ``trainer.save_model`` (a PEFT model's adapter folder,
which ``PeftModel.from_pretrained`` loads onto its base) or ``ElixirModule.state_dict()``.

Every file name export reads or writes comes from the index, which ``resolve`` checks whole
(``names.py``) before the output folder is created: a crafted ``hf_files`` entry such as
``../../x`` or a symlink out of the checkpoint is refused, and nothing is written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from hf_elixir.checkpoint import atomic
from hf_elixir.checkpoint.errors import CheckpointError
from hf_elixir.checkpoint.frozen import SavedFrozen
from hf_elixir.checkpoint.index import INDEX_NAME, UNTRACKED_NAME, resolve, verify_hashes
from hf_elixir.checkpoint.io import SafetensorsWriter, TensorSpec, dtype_from_name, dtype_name
from hf_elixir.checkpoint.names import member
from hf_elixir.checkpoint.reshard import SavedSlices
from hf_elixir.vocab import parse_bytes, torch_dtype

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
def parse_size(size: int | str) -> int:
    """Bytes from 5GB (powers of 1000, like transformers), 2GiB (powers of 1024) or an int."""
    return parse_bytes(size, "max_shard_size", CheckpointError)


def parse_dtype(dtype: None | str | torch.dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return torch_dtype(dtype, CheckpointError)


def export(directory: str | os.PathLike, output: str | os.PathLike, dtype=None,
           max_shard_size: int | str = "5GB", verify: bool = True) -> dict[str, Any]:
    """Write ``output/model.safetensors`` (or shards plus ``model.safetensors.index.json``),
    ``config.json``, ``generation_config.json`` and tokenizer files from checkpoint ``directory``.

    ``dtype``: cast floating tensors to this dtype (default: each parameter's dtype before
    training). The output directory is written under a temporary name and renamed when
    complete. Returns a summary (files, total bytes, largest tensor bytes). A checkpoint that
    does not hold its frozen weights (a LoRA run's) is refused, saying what to do instead
    (module docstring).
    """
    out_dtype = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    path, index = resolve(directory)
    _refuse_without_frozen_base(path, index)
    output = Path(output).absolute()
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointError(f"{output} exists and is not empty; export into a new or empty directory")
    if verify:
        verify_hashes(path, index, [n for n, f in index["files"].items() if f.get("kind") != "optimizer"])

    # what goes out, in the model's state_dict order; tied duplicates are left to from_pretrained
    entries: dict[str, dict] = {}
    for p in index["params"]:
        entries[p["name"]] = {"shape": p["shape"], "dtype": dtype_from_name(p["dtype"]), "numel": p["numel"]}
    for u in index.get("untracked", []):
        entries[u["name"]] = {"shape": u["shape"], "dtype": dtype_from_name(u["dtype"]),
                              "numel": _numel(u["shape"])}
    order = [k for k in index.get("state_dict_keys", []) if k in entries]
    order += [k for k in entries if k not in order]
    specs = []
    for key in order:
        e = entries[key]
        want = e["dtype"]
        if out_dtype is not None and want.is_floating_point:
            want = out_dtype
        specs.append(TensorSpec(key, want, tuple(e["shape"])))

    # pack into shards of at most ``limit`` bytes (a bigger tensor gets a shard of its own)
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    n = len(shards)
    names = [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    tmp = atomic.tmp_name(output, os.urandom(6).hex())
    tmp.mkdir(parents=True)
    source = SavedSlices(path, index)
    largest = 0
    try:
        for fname, shard in zip(names, shards):
            writer = SafetensorsWriter(tmp / fname, shard, metadata={"format": "pt"})
            for spec in shard:
                tensor = _assemble(source, spec.key, entries[spec.key])
                if tensor.dtype != spec.dtype:
                    tensor = tensor.to(spec.dtype)
                largest = max(largest, spec.numel * 4)
                writer.write(spec.key, tensor)
                del tensor
            writer.close()
        total = sum(s.nbytes for s in specs)
        if n > 1:
            weight_map = {spec.key: fname for fname, shard in zip(names, shards) for spec in shard}
            (tmp / WEIGHTS_INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        for fname in index.get("hf_files", []):  # names checked by resolve(); again here, at the join
            source_file = member(path, fname, str(path / INDEX_NAME)).resolve()
            shutil.copyfile(source_file, member(tmp, fname, f"export to {output}"))
        if out_dtype is not None and (tmp / "config.json").exists():
            config = json.loads((tmp / "config.json").read_text())
            for key in ("dtype", "torch_dtype"):
                if key in config or key == "dtype":
                    config[key] = dtype_name(out_dtype)
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if output.exists():
            output.rmdir()
        os.rename(tmp, output)
        atomic.fsync_dir(output.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        source.close()
    return {"output": str(output), "files": names + ([WEIGHTS_INDEX_NAME] if n > 1 else []),
            "total_bytes": total, "largest_tensor_bytes": largest, "tensors": len(specs),
            "has_config": "config.json" in index.get("hf_files", [])}


def _refuse_without_frozen_base(path: Path, index: dict) -> None:
    """A checkpoint that recorded frozen weights by digest only cannot be exported alone."""
    saved = SavedFrozen.from_index(index, str(path / INDEX_NAME))
    if saved is None or not saved.records:
        return
    names = list(saved.records)
    raise CheckpointError(
        f"{path}: this checkpoint holds only the trainable state of a model with frozen weights "
        f"({len(names)} frozen tensors, {saved.nbytes / 2**20:.1f} MiB, e.g. {names[0]!r}), which "
        "checkpoints do not store, so it cannot be exported on its own. Build the model on the base it "
        "was trained from, load this checkpoint into it (hf_elixir.checkpoint.load, "
        "accelerator.load_state, or the Trainer's resume_from_checkpoint), then save with "
        "accelerator.save_model / trainer.save_model (for a PEFT model: the adapter folder that "
        "PeftModel.from_pretrained loads onto its base) or take ElixirModule.state_dict() for the full weights"
    )


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _assemble(source: SavedSlices, key: str, entry: dict) -> torch.Tensor:
    """One whole tensor: from the fp32 slices of a chunked parameter, or from the untracked file."""
    if key in source.params:
        out = torch.empty(entry["numel"], dtype=torch.float32)
        source.read(key, 0, entry["numel"], out)
        return out.view(entry["shape"])
    return source.reader(UNTRACKED_NAME).read_tensor(key)
