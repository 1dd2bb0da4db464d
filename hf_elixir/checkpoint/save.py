"""Save a sharded checkpoint: every rank writes its own slices, rank 0 the rest and, last,
the index; the new folder replaces the old one only when complete.

Layout (docs/checkpoints.md)::

    ckpt/
      elixir_index.json                          written last by rank 0: format version, world
                                                 size, plan and digest, every parameter's name,
                                                 shape, dtype, chunk, offset and slices, file map
                                                 with sizes and sha256
      model-rank-00000-of-00002.safetensors      rank 0's fp32 master slices, one per parameter
      optimizer-rank-00000-of-00002.safetensors  "<name>/exp_avg", "<name>/exp_avg_sq",
                                                 "<name>/step" for the same slices
      model-untracked.safetensors                buffers and non-floating parameters (rank 0)
      optimizer_state.json                       param_groups, loss scaler
      scheduler.json, extra.json                 when given
      config.json, generation_config.json, tokenizer files   when the model / extra has them

Every parameter is stored as the slices the ranks own: slice ``[begin, end)`` of the
flattened parameter lives in rank r's files under the parameter's name (``reshard.py`` reads
them back at any world size). Nothing is gathered: a rank writes only its own shards (plus
small JSON). The runtime's state is read through ``hf_elixir.runtime.state``.

Frozen parameters (frozen chunks: a PEFT base, frozen embeddings) are not written at all:
the index's ``frozen`` entry records their names, shapes, dtypes and digests
(``frozen.py``), and a load takes them from the model it loads into after checking that
they are the same (names, shapes, digests), so a LoRA checkpoint is the size of its adapters
and their optimizer state. Such checkpoints carry format version 2; checkpoints of models
without frozen parameters keep the version-1 format unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch

from hf_elixir.checkpoint import atomic
from hf_elixir.checkpoint import frozen as frz
from hf_elixir.checkpoint.common import LocalPart, agree, frozen_digests, to_json_value, whole_tensors
from hf_elixir.checkpoint.errors import CheckpointError
from hf_elixir.checkpoint.index import (
    EXTRA_NAME, FORMAT, FORMAT_VERSION, INDEX_NAME, OPTIMIZER_STATE_NAME, PLAIN_FORMAT_VERSION,
    SCHEDULER_NAME, UNTRACKED_NAME, model_file, optimizer_file, read_index,
)
from hf_elixir.checkpoint.io import SafetensorsWriter, TensorSpec, dtype_name, file_sha256, write_json, write_safetensors
from hf_elixir.checkpoint.names import member, plain_name
from hf_elixir.runtime import state


def save(emodel, eoptimizer, directory: str | os.PathLike, extra: Optional[dict] = None, *,
         scheduler=None) -> Path:
    """Save a sharded checkpoint of ``emodel`` (and ``eoptimizer``, ``scheduler``) atomically.

    Collective: call on every rank with the same ``directory`` (on a file system all ranks
    share). Each rank writes its own fp32 master slices and optimizer state; rank 0 writes
    the small files and, last, the index; the new directory replaces the old one only when
    complete. ``extra``: optional dict; ``"tokenizer"`` (anything with ``save_pretrained``)
    is saved with the model so export can ship it; ``"files"`` maps file names to bytes or
    paths to copy in; every other key must be JSON and comes back from ``load()``.
    """
    comm = emodel.comm
    rank = comm.rank
    final = Path(directory).absolute()
    fault = atomic.FaultInjector.from_env(rank)
    extra = dict(extra or {})

    # Each step below is a local part on each rank and one agreement (common.agree): an
    # exception of any type on one rank makes every rank raise there, none waits forever.
    # ---- rank 0 checks the target and picks the temporary name; every rank learns both
    part = LocalPart.run(_prepare, final, extra) if rank == 0 else LocalPart()
    nonce = agree(comm, part, f"saving {final}", share=part.value)[0]
    tmp = atomic.tmp_name(final, nonce)

    # ---- the frozen weights' digests (each rank adds up its own shards; nothing is gathered)
    frozen_entry = None
    if frz.frozen_slots(emodel):
        dtypes = frz.digest_dtypes_for_save(frz.held_dtype(emodel))
        frozen_entry = frz.index_entry(emodel, frozen_digests(emodel, dtypes))

    failed = f"saving {final} failed, the previous checkpoint (if any) is unchanged"
    # ---- phase 1: every rank writes its shards
    part = LocalPart.run(_write_shards, emodel, eoptimizer, tmp, fault)
    try:
        infos = agree(comm, part, f"{failed}: rank {rank} writing {tmp}", share=part.value)
    except BaseException:
        if rank == 0:  # every rank has stopped writing: the agreement is past
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    # ---- phase 2: rank 0 writes the rest, the index, and commits
    part = LocalPart()
    if rank == 0:
        part = LocalPart.run(_finish, emodel, eoptimizer, scheduler, extra, tmp, final, nonce, infos, fault,
                             frozen_entry)
    agree(comm, part, failed)
    return final


def _prepare(final: Path, extra: dict) -> str:
    """Rank 0's check of the target and of ``extra``; the temporary folder's nonce."""
    json_extra = {k: v for k, v in extra.items() if k not in ("tokenizer", "files")}
    to_json_value(json_extra, "extra")
    for fname in extra.get("files") or {}:
        plain_name(fname, "extra['files']")
    _prepare_target(final)
    return uuid.uuid4().hex[:12]


def _write_shards(emodel, eoptimizer, tmp: Path, fault) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    return _write_rank_files(emodel, eoptimizer, tmp, fault)


def _finish(emodel, eoptimizer, scheduler, extra: dict, tmp: Path, final: Path, nonce: str, infos: list,
            fault, frozen: Optional[dict]) -> None:
    """Rank 0: the small files, the index, and the commit; the temporary folder is removed
    if any of it fails."""
    try:
        _write_rank0_files(emodel, eoptimizer, scheduler, extra, tmp, infos, fault, frozen=frozen)
        atomic.commit(tmp, final, nonce, fault)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _prepare_target(final: Path) -> None:
    """Refuse to replace a directory that is not a checkpoint; finish an interrupted swap;
    delete what interrupted saves left behind."""
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"{final} exists and is not a directory; choose another checkpoint path")
    if final.is_dir() and not (final / INDEX_NAME).exists() and any(final.iterdir()):
        raise CheckpointError(
            f"{final} exists and is not an hf_elixir checkpoint (no {INDEX_NAME}); refusing to replace "
            "it: choose an empty or new directory"
        )
    if final.is_dir() and not any(final.iterdir()):
        final.rmdir()
    if not final.exists():
        # killed between the two renames: put the previous checkpoint back first
        for backup in atomic.leftovers(final, atomic.OLD_MARK):
            try:
                read_index(backup)
            except CheckpointError:
                continue
            os.rename(backup, final)
            atomic.fsync_dir(final.parent)
            break
    for mark in (atomic.TMP_MARK, atomic.OLD_MARK):
        for stale in atomic.leftovers(final, mark):
            shutil.rmtree(stale, ignore_errors=True)


def _write_rank_files(emodel, eoptimizer, tmp: Path, fault) -> dict[str, Any]:
    """This rank's model and optimizer shards, written straight from the flat shards, one
    chunk at a time (a chunk on the disk tier is read into its ring for the time it takes)."""
    rank, world = emodel.comm.rank, emodel.comm.world_size
    meta = {"format": "pt", "hf_elixir": "sharded", "rank": str(rank), "world_size": str(world)}
    files: dict[str, dict] = {}
    local = state.local_slices(emodel, eoptimizer)  # the names and sizes: the files' headers

    name = model_file(rank, world)
    writer = SafetensorsWriter(tmp / name, [TensorSpec(s.name, s.master.dtype, tuple(s.master.shape)) for s in local],
                               meta, before_write=fault)
    for piece in state.chunk_slices(emodel):
        for s in piece:
            writer.write(s.name, s.master)
    size, digest = writer.close(before_fsync=fault)
    files[name] = {"size": size, "sha256": digest, "rank": rank, "kind": "model"}

    if eoptimizer is not None:
        counters = state.read_counters(eoptimizer)
        specs: list[TensorSpec] = []
        for s in local:
            specs += [TensorSpec(f"{s.name}/{sname}", view.dtype, tuple(view.shape)) for sname, view in s.state.items()]
            specs.append(TensorSpec(f"{s.name}/step", torch.float32, ()))
        started = [s.name for s in local if s.name in counters.momentum_started]
        name = optimizer_file(rank, world)
        writer = SafetensorsWriter(tmp / name, specs, {**meta, "momentum_started": json.dumps(started)},
                                   before_write=fault)
        for piece in state.chunk_slices(emodel, eoptimizer):
            for s in piece:
                for sname, view in s.state.items():
                    writer.write(f"{s.name}/{sname}", view)
                writer.write(f"{s.name}/step", state.step_tensor(eoptimizer, s.slot))
        size, digest = writer.close(before_fsync=fault)
        files[name] = {"size": size, "sha256": digest, "rank": rank, "kind": "optimizer"}
    return files


def _sync_file(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return path.stat().st_size, file_sha256(path)


def _write_rank0_files(emodel, eoptimizer, scheduler, extra: dict, tmp: Path, rank_infos: list, fault,
                       frozen: Optional[dict] = None) -> None:
    world = emodel.comm.world_size
    module = state.wrapped_module(emodel)
    files: dict[str, dict] = {}
    for info in rank_infos:
        files.update(info)

    # buffers (and non-floating parameters), whole, once; frozen chunks are not stored
    untracked, aliases = whole_tensors(emodel)
    size, digest = write_safetensors(
        tmp / UNTRACKED_NAME, [(k, v.cpu().contiguous()) for k, v in untracked.items()],
        metadata={"format": "pt", "hf_elixir": "untracked"}, fault=fault)
    files[UNTRACKED_NAME] = {"size": size, "sha256": digest, "rank": None, "kind": "untracked"}

    optimizer_meta = None
    if eoptimizer is not None:
        groups = []
        for gi, (group, names) in enumerate(zip(eoptimizer.param_groups, state.group_parameter_names(eoptimizer))):
            packed = {k: to_json_value(v, f"param_groups[{gi}][{k!r}]") for k, v in group.items() if k != "params"}
            packed["param_names"] = names
            groups.append(packed)
        saved = {"algorithm": eoptimizer.algorithm, "param_groups": groups,
                 "loss_scaler": eoptimizer.scaler.state_dict() if eoptimizer.scaler is not None else None}
        size, digest = write_json(tmp / OPTIMIZER_STATE_NAME, saved, fault)
        files[OPTIMIZER_STATE_NAME] = {"size": size, "sha256": digest, "rank": None, "kind": "json"}
        optimizer_meta = {"algorithm": eoptimizer.algorithm, "state_names": state.state_names(eoptimizer)}
    if scheduler is not None:
        size, digest = write_json(tmp / SCHEDULER_NAME, to_json_value(scheduler.state_dict(), "scheduler"), fault)
        files[SCHEDULER_NAME] = {"size": size, "sha256": digest, "rank": None, "kind": "json"}
    json_extra = {k: v for k, v in extra.items() if k not in ("tokenizer", "files")}
    if json_extra:
        size, digest = write_json(tmp / EXTRA_NAME, to_json_value(json_extra, "extra"), fault)
        files[EXTRA_NAME] = {"size": size, "sha256": digest, "rank": None, "kind": "json"}

    # what a from_pretrained folder needs besides the weights
    hf_files: list[str] = []
    before = set(os.listdir(tmp))
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        fault("write config.json")
        config.to_json_file(tmp / "config.json")
    gen = getattr(module, "generation_config", None)
    if gen is not None and hasattr(gen, "to_json_file"):
        fault("write generation_config.json")
        gen.to_json_file(tmp / "generation_config.json")
    tokenizer = extra.get("tokenizer")
    if tokenizer is not None:
        if not hasattr(tokenizer, "save_pretrained"):
            raise CheckpointError(f"extra['tokenizer'] ({type(tokenizer).__name__}) has no save_pretrained()")
        fault("write tokenizer")
        tokenizer.save_pretrained(str(tmp))
    for fname, content in (extra.get("files") or {}).items():
        if fname in files or fname == INDEX_NAME:
            raise CheckpointError(f"extra['files']: {fname!r} must be a file name not used by the checkpoint")
        target = member(tmp, fname, "extra['files']")
        fault(f"write {fname}")
        if isinstance(content, (bytes, bytearray)):
            target.write_bytes(content)
        else:
            shutil.copyfile(content, target)
    for fname in sorted(set(os.listdir(tmp)) - before):
        path = member(tmp, fname, "the files saved beside the model")  # a reader would refuse it
        if not path.is_file():
            raise CheckpointError(f"{path}: extra files must be plain files, not folders")
        fault(f"fsync {fname}")
        size, digest = _sync_file(path)
        files[fname] = {"size": size, "sha256": digest, "rank": None, "kind": "hf"}
        if fname not in (extra.get("files") or {}):
            hf_files.append(fname)

    params = [{"name": p.name, "shape": list(p.shape), "dtype": dtype_name(p.dtype), "chunk": p.chunk,
               "offset": p.offset, "numel": p.numel, "slices": [list(o) for o in p.owners]}
              for p in state.parameter_layouts(emodel)]
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION if frozen is not None else PLAIN_FORMAT_VERSION,
        "world_size": world,
        "plan_digest": emodel.plan.digest(),
        "plan": emodel.plan.to_dict(),
        "chunk_size": emodel.plan.chunk_size,
        "compute_dtype": emodel.plan.compute_dtype,
        "model_class": type(module).__name__,
        "params": params,
        "untracked": [{"name": k, "shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in untracked.items()],
        "aliases": aliases,
        **({"frozen": frozen} if frozen is not None else {}),
        "state_dict_keys": list(module.state_dict(keep_vars=True).keys()),
        "optimizer": optimizer_meta,
        "hf_files": hf_files,
        "rank_files": [
            {"model": model_file(r, world), "optimizer": optimizer_file(r, world) if eoptimizer is not None else None}
            for r in range(world)
        ],
        "files": files,
    }
    write_json(tmp / INDEX_NAME, index, fault)
    fault(f"fsync {tmp.name}")
    atomic.fsync_dir(tmp)
