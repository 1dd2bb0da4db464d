"""Save and load sharded checkpoints; load reshards to any world size and plan.

Layout (DESIGN.md section 5)::

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
flattened parameter lives in rank r's files under the parameter's name. Loading copies,
for each slice the loading rank now owns, the overlapping parts of the saved slices, so any
world size, chunk size or placement can be rebuilt; values are copied bit for bit.

Neither side gathers: a rank writes and reads only its own shards (plus small JSON).

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
import torch.distributed as dist

from hf_elixir.checkpoint import atomic
from hf_elixir.checkpoint import frozen as frz
from hf_elixir.checkpoint.errors import CheckpointError
from hf_elixir.checkpoint.index import (
    EXTRA_NAME, FORMAT, FORMAT_VERSION, INDEX_NAME, OPTIMIZER_STATE_NAME, PLAIN_FORMAT_VERSION,
    SCHEDULER_NAME, UNTRACKED_NAME, model_file, optimizer_file, read_index, resolve, verify_hashes,
)
from hf_elixir.checkpoint.io import (
    SafetensorsReader, dtype_name, write_json, write_safetensors,
)


# ---------------------------------------------------------------------- collectives
def _all_gather_object(comm, obj: Any) -> list[Any]:
    if not comm.distributed:
        return [obj]
    out: list[Any] = [None] * comm.world_size
    dist.all_gather_object(out, obj, group=comm.gather_group)
    return out


def _raise_if_any(comm, error: Optional[str]) -> None:
    """Every rank raises if any rank failed, so no rank changes state or waits forever."""
    errors = _all_gather_object(comm, error)
    for rank, message in enumerate(errors):
        if message is not None:
            suffix = f" (reported by rank {rank})" if comm.distributed and rank != comm.rank else ""
            raise CheckpointError(message + suffix)


# ---------------------------------------------------------------------- layout helpers
def _untracked(module: torch.nn.Module, slot_ids: set[int]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State-dict entries that are not chunked (frozen parameters, persistent buffers), each
    once, and the aliases (tied keys) of every entry, chunked or not."""
    tensors: dict[str, torch.Tensor] = {}
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    slot_name = {}
    for name, p in module.named_parameters():
        slot_name.setdefault(id(p), name)
    for key, value in module.state_dict(keep_vars=True).items():
        if value is None:
            continue
        vid = id(value)
        if vid in slot_ids:
            if slot_name.get(vid) != key:
                aliases[key] = slot_name[vid]
            continue
        if vid in canonical:
            aliases[key] = canonical[vid]
            continue
        canonical[vid] = key
        tensors[key] = value.detach()
    return tensors, aliases


def _jsonable(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"__tensor__": value.item()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, where) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"{where}: cannot store a value of type {type(value).__name__} ({value!r:.80}) "
                          "in a checkpoint; only numbers, strings, lists and dicts are saved")


def _from_json(value: Any, like: Any = None) -> Any:
    if isinstance(value, dict) and set(value) == {"__tensor__"}:
        return torch.tensor(value["__tensor__"])
    if isinstance(value, list) and isinstance(like, tuple):
        return tuple(value)
    return value


def _group_names(eoptimizer) -> list[list[str]]:
    names = {}
    for name, p in eoptimizer.module.module.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), name)
    return [[names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(g["params"])] for g in eoptimizer.param_groups]


# ---------------------------------------------------------------------- save
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

    # ---- rank 0 checks the target and picks the temporary name; every rank learns both
    prep: dict[str, Any] = {}
    if rank == 0:
        try:
            json_extra = {k: v for k, v in extra.items() if k not in ("tokenizer", "files")}
            _jsonable(json_extra, "extra")
            _prepare_target(final)
            prep = {"nonce": uuid.uuid4().hex[:12], "error": None}
        except (CheckpointError, OSError) as e:
            prep = {"nonce": None, "error": str(e)}
    prep = _all_gather_object(comm, prep)[0]
    if prep["error"]:
        raise CheckpointError(prep["error"])
    nonce = prep["nonce"]
    tmp = atomic.tmp_name(final, nonce)

    # ---- the frozen weights' digests (each rank adds up its own shards; nothing is gathered)
    frozen_entry = None
    if frz.frozen_chunks(emodel):
        dtypes = frz.digest_dtypes_for_save(frz.held_dtype(emodel))
        frozen_entry = frz.index_entry(emodel, _frozen_digests(emodel, dtypes))

    # ---- phase 1: every rank writes its shards
    info, error = None, None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        info = _write_rank_files(emodel, eoptimizer, tmp, fault)
    except (OSError, CheckpointError) as e:
        error = f"rank {rank}: writing {tmp}: {e}"
    infos = _all_gather_object(comm, (info, error))
    errors = [e for _, e in infos if e]
    # ---- phase 2: rank 0 writes the rest, the index, and commits
    status = None
    if rank == 0:
        try:
            if errors:
                raise CheckpointError("; ".join(errors))
            _write_rank0_files(emodel, eoptimizer, scheduler, extra, tmp, [i for i, _ in infos], fault,
                               frozen=frozen_entry)
            atomic.commit(tmp, final, nonce, fault)
        except (OSError, CheckpointError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            status = str(e)
    status = _all_gather_object(comm, status)[0]
    if status:
        raise CheckpointError(f"saving {final} failed, the previous checkpoint (if any) is unchanged: {status}")
    return final


def _frozen_digests(emodel, dtypes: list[torch.dtype]) -> dict[str, dict[str, str]]:
    """Every frozen parameter's digest in each of ``dtypes`` (collective; the same result on
    every rank). A rank that cannot compute its share makes every rank raise."""
    partial, error = None, None
    try:
        partial = frz.local_partials(emodel, dtypes)
    except CheckpointError as e:
        error = f"rank {emodel.comm.rank}: {e}"
    parts = _all_gather_object(emodel.comm, (partial, error))
    errors = [e for _, e in parts if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    return frz.combine([p for p, _ in parts], [s.name for s in frz.frozen_slots(emodel)], dtypes)


def _trainable_chunks(emodel) -> list:
    return [c for c in emodel.chunks if not c.frozen]


def _state_names(eoptimizer) -> list[str]:
    """The optimizer state every trainable shard has (frozen chunks keep none)."""
    for chunk, state in zip(eoptimizer.module.chunks, eoptimizer.flat_state):
        if not chunk.frozen:
            return list(state)
    return []


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
    """This rank's model and optimizer shards, written straight from the flat shards."""
    rank, world = emodel.comm.rank, emodel.comm.world_size
    meta = {"format": "pt", "hf_elixir": "sharded", "rank": str(rank), "world_size": str(world)}
    files: dict[str, dict] = {}
    local = [(chunk, slot, b, e) for chunk in _trainable_chunks(emodel) for slot, b, e, _ in chunk.local_slices()]

    name = model_file(rank, world)
    size, digest = write_safetensors(
        tmp / name, [(slot.name, chunk.master[b:e]) for chunk, slot, b, e in local],
        metadata=meta, fault=fault)
    files[name] = {"size": size, "sha256": digest, "rank": rank, "kind": "model"}

    if eoptimizer is not None:
        flat_state = eoptimizer.flat_state
        items: list[tuple[str, torch.Tensor]] = []
        started = []
        for chunk, slot, b, e in local:
            for sname, flat in flat_state[chunk.index].items():
                items.append((f"{slot.name}/{sname}", flat[b:e]))
            items.append((f"{slot.name}/step", eoptimizer.steps[slot.index].detach().float().cpu().reshape(())))
            if slot.index in eoptimizer._momentum_started:
                started.append(slot.name)
        name = optimizer_file(rank, world)
        size, digest = write_safetensors(
            tmp / name, items, metadata={**meta, "momentum_started": json.dumps(started)}, fault=fault)
        files[name] = {"size": size, "sha256": digest, "rank": rank, "kind": "optimizer"}
    return files


def _sync_file(path: Path) -> tuple[int, str]:
    from hf_elixir.checkpoint.io import file_sha256

    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return path.stat().st_size, file_sha256(path)


def _write_rank0_files(emodel, eoptimizer, scheduler, extra: dict, tmp: Path, rank_infos: list, fault,
                       frozen: Optional[dict] = None) -> None:
    world = emodel.comm.world_size
    module = emodel.module
    files: dict[str, dict] = {}
    for info in rank_infos:
        files.update(info)

    # buffers (and non-floating parameters), whole, once; frozen chunks are not stored
    slot_ids = {id(s.param) for s in emodel.slots}
    untracked, aliases = _untracked(module, slot_ids)
    size, digest = write_safetensors(
        tmp / UNTRACKED_NAME, [(k, v.cpu().contiguous()) for k, v in untracked.items()],
        metadata={"format": "pt", "hf_elixir": "untracked"}, fault=fault)
    files[UNTRACKED_NAME] = {"size": size, "sha256": digest, "rank": None, "kind": "untracked"}

    optimizer_meta = None
    if eoptimizer is not None:
        groups = []
        for gi, (group, names) in enumerate(zip(eoptimizer.param_groups, _group_names(eoptimizer))):
            packed = {k: _jsonable(v, f"param_groups[{gi}][{k!r}]") for k, v in group.items() if k != "params"}
            packed["param_names"] = names
            groups.append(packed)
        state = {"algorithm": eoptimizer.algorithm, "param_groups": groups,
                 "loss_scaler": eoptimizer.scaler.state_dict() if eoptimizer.scaler is not None else None}
        size, digest = write_json(tmp / OPTIMIZER_STATE_NAME, state, fault)
        files[OPTIMIZER_STATE_NAME] = {"size": size, "sha256": digest, "rank": None, "kind": "json"}
        optimizer_meta = {"algorithm": eoptimizer.algorithm, "state_names": _state_names(eoptimizer)}
    if scheduler is not None:
        size, digest = write_json(tmp / SCHEDULER_NAME, _jsonable(scheduler.state_dict(), "scheduler"), fault)
        files[SCHEDULER_NAME] = {"size": size, "sha256": digest, "rank": None, "kind": "json"}
    json_extra = {k: v for k, v in extra.items() if k not in ("tokenizer", "files")}
    if json_extra:
        size, digest = write_json(tmp / EXTRA_NAME, _jsonable(json_extra, "extra"), fault)
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
        if Path(fname).name != fname or fname in files or fname == INDEX_NAME:
            raise CheckpointError(f"extra['files']: {fname!r} must be a plain file name not used by the checkpoint")
        fault(f"write {fname}")
        if isinstance(content, (bytes, bytearray)):
            (tmp / fname).write_bytes(content)
        else:
            shutil.copyfile(content, tmp / fname)
    for fname in sorted(set(os.listdir(tmp)) - before):
        path = tmp / fname
        if not path.is_file():
            raise CheckpointError(f"{path}: extra files must be plain files, not folders")
        fault(f"fsync {fname}")
        size, digest = _sync_file(path)
        files[fname] = {"size": size, "sha256": digest, "rank": None, "kind": "hf"}
        if fname not in (extra.get("files") or {}):
            hf_files.append(fname)

    params = []
    for slot in (s for c in _trainable_chunks(emodel) for s in c.slots):
        slices = []
        for r in range(world):
            for s, b, e, pb in _rank_slices_for_slot(emodel, slot, r):
                slices.append([r, pb, pb + e - b])
        params.append({"name": slot.name, "shape": list(slot.shape), "dtype": dtype_name(slot.orig_dtype),
                       "chunk": _chunk_of(emodel, slot), "offset": slot.offset, "numel": slot.numel,
                       "slices": slices})
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


def _chunk_of(emodel, slot) -> int:
    for chunk in emodel.chunks:
        if slot.offset < chunk.size and any(s is slot for s in chunk.slots):
            return chunk.index
    raise AssertionError(slot.name)


def _rank_slices_for_slot(emodel, slot, rank: int):
    chunk = emodel.chunks[_chunk_of(emodel, slot)]
    lo = rank * chunk.shard_size
    rng = slot.local_range(lo, lo + chunk.shard_size)
    return [] if rng is None else [(slot, *rng)]


# ---------------------------------------------------------------------- load
class _Source:
    """Reads any element range of a saved parameter (or of its optimizer state) by copying
    the overlapping parts of the saved slices; files are opened on first use."""

    def __init__(self, path: Path, index: dict) -> None:
        self.path = path
        self.index = index
        self.params = {p["name"]: p for p in index["params"]}
        self.untracked = {u["name"]: u for u in index.get("untracked", [])}
        self._readers: dict[str, SafetensorsReader] = {}

    def reader(self, fname: str) -> SafetensorsReader:
        if fname not in self._readers:
            self._readers[fname] = SafetensorsReader(self.path / fname)
        return self._readers[fname]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def files_for(self, name: str, begin: int, end: int, kind: str) -> list[str]:
        if name not in self.params:
            return [UNTRACKED_NAME] if kind == "model" and name in self.untracked else []
        out = []
        for r, sb, se in self.params[name]["slices"]:
            if sb < end and begin < se:
                out.append(self.index["rank_files"][r][kind])
        return out

    def read(self, name: str, begin: int, end: int, out: torch.Tensor, state: Optional[str] = None) -> None:
        """Fill ``out`` (fp32, end-begin elements) with elements [begin, end) of ``name``
        (or of its optimizer state ``state``)."""
        if name not in self.params:  # saved frozen: whole in the untracked file
            tmp = self.reader(UNTRACKED_NAME).read(name, begin, end)
            out.copy_(tmp)
            return
        kind = "model" if state is None else "optimizer"
        key = name if state is None else f"{name}/{state}"
        for r, sb, se in self.params[name]["slices"]:
            lo, hi = max(begin, sb), min(end, se)
            if lo >= hi:
                continue
            reader = self.reader(self.index["rank_files"][r][kind])
            dst = out[lo - begin : hi - begin]
            if dst.device.type == "cpu" and dst.dtype == torch.float32 and dst.is_contiguous():
                reader.read(key, lo - sb, hi - sb, out=dst)
            else:
                dst.copy_(reader.read(key, lo - sb, hi - sb))

    def step(self, name: str) -> float:
        r = self.params[name]["slices"][0][0]
        return float(self.reader(self.index["rank_files"][r]["optimizer"]).read(f"{name}/step")[0])


def _check_model(emodel, index: dict, path: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint must hold exactly this model's tensors with these shapes, and the same
    ones frozen (their values are checked by digest later, collectively)."""
    where = path / INDEX_NAME
    saved_frozen = frz.SavedFrozen.from_index(index, str(where))
    saved = {p["name"]: tuple(p["shape"]) for p in index["params"]}
    saved.update({u["name"]: tuple(u["shape"]) for u in index.get("untracked", [])})
    if saved_frozen is not None:
        saved.update({n: r.shape for n, r in saved_frozen.records.items()})
    own = {s.name: tuple(s.shape) for s in emodel.slots}
    untracked, _ = _untracked(emodel.module, {id(s.param) for s in emodel.slots})
    own.update({k: tuple(v.shape) for k, v in untracked.items()})
    only_saved = sorted(set(saved) - set(own))
    only_own = sorted(set(own) - set(saved))
    if only_saved or only_own:
        raise CheckpointError(
            f"{where}: the checkpoint was saved from another model ({index.get('model_class')}): "
            f"tensors only in the checkpoint: {only_saved[:5]}{' ...' if len(only_saved) > 5 else ''}; "
            f"only in this model: {only_own[:5]}{' ...' if len(only_own) > 5 else ''}"
        )
    _check_frozen_roles(emodel, index, saved_frozen, str(where))
    wrong = [(n, saved[n], own[n]) for n in own if saved[n] != own[n]]
    if wrong:
        n, a, b = wrong[0]
        raise CheckpointError(
            f"{where}: the checkpoint was saved from another model: {n!r} has shape {list(a)} in the "
            f"checkpoint and {list(b)} in this model ({len(wrong)} tensors differ)"
        )
    for p in index["params"]:
        covered = sorted((sb, se) for _, sb, se in p["slices"])
        pos = 0
        for sb, se in covered:
            if sb != pos:
                break
            pos = se
        if pos != p["numel"]:
            raise CheckpointError(f"{where}: the slices of {p['name']!r} do not cover it; the index is corrupted")
    return list(untracked.items())


def _check_frozen_roles(emodel, index: dict, saved: Optional[frz.SavedFrozen], where: str) -> None:
    """The parameters frozen here must be those frozen when the checkpoint was saved: it holds
    no values for those, and values without optimizer state for the others. (Frozen ones
    saved whole in the untracked file, by version-1 checkpoints, are restored from there.)"""
    own_frozen = [s.name for s in frz.frozen_slots(emodel)]
    frozen_here = set(own_frozen)
    trainable = {p["name"] for p in index["params"]}
    now_frozen = [n for n in own_frozen if n in trainable]             # in the plan's order
    now_trainable = [n for n in (saved.records if saved is not None else ()) if n not in frozen_here]
    if now_frozen:
        raise CheckpointError(
            f"{where}: {now_frozen[0]!r} was trainable when the checkpoint was saved and is frozen "
            f"(requires_grad=False) in this model ({len(now_frozen)} such tensors); make the same "
            "parameters trainable as the run that saved it (to freeze trained weights, export or "
            "state_dict() them and build the model from those)")
    if now_trainable:
        raise CheckpointError(
            f"{where}: {now_trainable[0]!r} was frozen when the checkpoint was saved and is trainable "
            f"in this model ({len(now_trainable)} such tensors); the checkpoint holds no values or "
            "optimizer state for frozen weights: freeze the same parameters as the run that saved it")
    if saved is not None and saved.fingerprint != frz.FINGERPRINT:
        raise CheckpointError(
            f"{where}: the frozen weights' digests were made with {saved.fingerprint!r}, this hf_elixir "
            f"makes {frz.FINGERPRINT!r}; load it with the hf_elixir version that saved it")


def _frozen_comparison(emodel, index: dict, where: str) -> Optional[torch.dtype]:
    """The dtype this model's frozen digests are compared in (None: nothing to compare)."""
    saved = frz.SavedFrozen.from_index(index, where)
    if saved is None or not saved.records:
        return None
    own_held = frz.held_dtype(emodel)
    dtype = frz.compare_dtype(own_held, saved)
    if dtype is None:
        raise CheckpointError(
            f"{where}: the checkpoint recorded its frozen weights' digests for {saved.held_dtype} values "
            f"and this model holds them in {dtype_name(own_held)}; they cannot be compared exactly: "
            f"resume with compute dtype {saved.held_dtype} (or float32)")
    return dtype


def _check_frozen_digests(emodel, index: dict, path: Path, dtype: torch.dtype) -> None:
    """Collective: compute this model's frozen digests and refuse (on every rank: the digests
    are the same everywhere) when they are not the checkpoint's. Changes nothing."""
    where = str(path / INDEX_NAME)
    saved = frz.SavedFrozen.from_index(index, where)
    own = _frozen_digests(emodel, [dtype])
    message = frz.digest_mismatch(saved, own, dtype, where)
    if message is not None:
        raise CheckpointError(message)


def _check_optimizer(eoptimizer, index: dict, path: Path, opt_state: dict) -> None:
    where = path / INDEX_NAME
    meta = index.get("optimizer")
    if meta is None:
        raise CheckpointError(f"{where}: the checkpoint has no optimizer state; load with eoptimizer=None "
                              "to restore the weights only")
    if meta["algorithm"] != eoptimizer.algorithm:
        raise CheckpointError(f"{where}: optimizer state is for {meta['algorithm']}, this optimizer is "
                              f"{eoptimizer.algorithm}; create the same kind of optimizer")
    own_names = _state_names(eoptimizer)
    if sorted(meta["state_names"]) != sorted(own_names):
        raise CheckpointError(f"{where}: optimizer state holds {meta['state_names']}, this optimizer "
                              f"keeps {own_names} (momentum on/off?); create the optimizer as it was")
    groups = opt_state["param_groups"]
    own_groups = _group_names(eoptimizer)
    if len(groups) != len(own_groups) or any(g["param_names"] != o for g, o in zip(groups, own_groups)):
        raise CheckpointError(
            f"{path / OPTIMIZER_STATE_NAME}: the optimizer's param_groups hold other parameters than "
            f"this optimizer's ({len(groups)} saved groups, {len(own_groups)} now); build the "
            "param_groups as in the run that saved it"
        )


def load(emodel, eoptimizer=None, directory: str | os.PathLike = None, *, scheduler=None,
         verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by ``save`` into ``emodel`` (and ``eoptimizer``, ``scheduler``).

    Collective. Works at any world size and with any plan: each rank reads the parts of the
    saved slices that its new shards hold. Everything is checked first (index, model
    names and shapes, optimizer kind and groups, file sizes, sha256 of every file this rank
    reads, safetensors headers, and that this model's frozen parameters are those the
    checkpoint was saved with: same names, shapes and digests, since it does not store them);
    on any problem every rank raises CheckpointError and nothing is changed. Returns
    ``{"path", "world_size", "resharded", "extra"}``.
    """
    if directory is None:
        raise TypeError("load() needs the checkpoint directory")
    comm = emodel.comm
    prepared, error = None, None
    try:
        prepared = _prepare_load(emodel, eoptimizer, scheduler, Path(directory).absolute(), verify)
    except CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"{directory}: {e}"
    try:
        _raise_if_any(comm, error)
        if prepared["frozen_dtype"] is not None:  # the same on every rank: read from one index
            _check_frozen_digests(emodel, prepared["index"], prepared["path"], prepared["frozen_dtype"])
    except CheckpointError:
        if prepared is not None:
            prepared["source"].close()
        raise
    try:
        return _apply(emodel, eoptimizer, scheduler, prepared)
    finally:
        prepared["source"].close()


def _prepare_load(emodel, eoptimizer, scheduler, directory: Path, verify: bool) -> dict:
    path, index = resolve(directory)
    untracked = _check_model(emodel, index, path)
    frozen_dtype = _frozen_comparison(emodel, index, str(path / INDEX_NAME))
    opt_state = sched_state = extra = None
    if eoptimizer is not None:
        opt_state = _read_json(path, OPTIMIZER_STATE_NAME, index)
        _check_optimizer(eoptimizer, index, path, opt_state)
    if scheduler is not None:
        if SCHEDULER_NAME not in index["files"]:
            raise CheckpointError(f"{path}: the checkpoint has no scheduler state; load without scheduler=")
        sched_state = _read_json(path, SCHEDULER_NAME, index)
    if EXTRA_NAME in index["files"]:
        extra = _read_json(path, EXTRA_NAME, index)
    source = _Source(path, index)
    try:
        # which files this rank reads
        needed: set[str] = {UNTRACKED_NAME}
        for chunk in emodel.chunks:
            for slot, b, e, pb in chunk.local_slices():
                needed.update(source.files_for(slot.name, pb, pb + e - b, "model"))
                if eoptimizer is not None:
                    needed.update(source.files_for(slot.name, pb, pb + e - b, "optimizer"))
        if verify:
            verify_hashes(path, index, sorted(needed))
        for fname in sorted(needed):  # headers parse, keys present with the recorded sizes
            reader = source.reader(fname)
            _check_keys(reader, fname, index, eoptimizer)
        steps: dict[str, float] = {}
        started: set[str] = set()
        if eoptimizer is not None:
            for chunk in _trainable_chunks(emodel):
                for slot, _, _, _ in chunk.local_slices():
                    steps[slot.name] = source.step(slot.name) if slot.name in source.params else 0.0
            for fname in sorted(needed):
                if fname.startswith("optimizer-"):
                    started.update(json.loads(source.reader(fname).metadata.get("momentum_started", "[]")))
    except BaseException:
        source.close()
        raise
    return {"path": path, "index": index, "source": source, "untracked": untracked, "frozen_dtype": frozen_dtype,
            "opt_state": opt_state, "sched_state": sched_state, "extra": extra, "steps": steps,
            "started": started}


def _read_json(path: Path, name: str, index: dict) -> Any:
    if name not in index["files"]:
        raise CheckpointError(f"{path}: the index lists no {name}; the checkpoint is corrupted")
    try:
        return json.loads((path / name).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / name}: not valid JSON ({e}); the file is corrupted") from None


def _check_keys(reader: SafetensorsReader, fname: str, index: dict, eoptimizer) -> None:
    if fname == UNTRACKED_NAME:
        for u in index.get("untracked", []):
            spec = reader.specs.get(u["name"])
            if spec is None or list(spec.shape) != u["shape"]:
                raise CheckpointError(f"{reader.path}: tensor {u['name']!r} is missing or has the wrong shape")
        return
    kind = "model" if fname.startswith("model-") else "optimizer"
    rank = next(r for r, rf in enumerate(index["rank_files"]) if rf[kind] == fname)
    names = index["optimizer"]["state_names"] if kind == "optimizer" else [None]
    for p in index["params"]:
        for r, sb, se in p["slices"]:
            if r != rank:
                continue
            for sname in names:
                key = p["name"] if sname is None else f"{p['name']}/{sname}"
                spec = reader.specs.get(key)
                if spec is None or spec.numel != se - sb or spec.dtype != torch.float32:
                    raise CheckpointError(f"{reader.path}: tensor {key!r} is missing or has the wrong size; "
                                          "the file does not match the index")


@torch.no_grad()
def _apply(emodel, eoptimizer, scheduler, prep: dict) -> dict[str, Any]:
    source: _Source = prep["source"]
    index = prep["index"]
    emodel.release_all()
    for chunk in emodel.chunks:
        for slot, b, e, pb in chunk.local_slices():
            if chunk.frozen and slot.name not in source.untracked:
                continue  # not stored: the model's own values (checked by digest) stay
            source.read(slot.name, pb, pb + e - b, chunk.master[b:e])
        if not chunk.master_aliased:
            chunk.shard.copy_(chunk.master)
    for name, tensor in prep["untracked"]:
        buf = torch.empty(tensor.numel(), dtype=torch.float32) if tensor.is_floating_point() else None
        if name in source.params:
            source.read(name, 0, tensor.numel(), buf)
            tensor.data.copy_(buf.view(tensor.shape))
        else:
            tensor.data.copy_(source.reader(UNTRACKED_NAME).read_tensor(name))
    if eoptimizer is not None:
        state_names = index["optimizer"]["state_names"]
        eoptimizer._momentum_started.clear()
        for chunk, flat in zip(emodel.chunks, eoptimizer.flat_state):
            if chunk.frozen:  # no optimizer state
                continue
            for slot, b, e, pb in chunk.local_slices():
                saved = slot.name in source.params
                for sname in state_names:
                    if saved:
                        source.read(slot.name, pb, pb + e - b, flat[sname][b:e], state=sname)
                    else:
                        flat[sname][b:e].zero_()
                eoptimizer.steps[slot.index].fill_(prep["steps"].get(slot.name, 0.0))
                if slot.name in prep["started"]:
                    eoptimizer._momentum_started.add(slot.index)
        for own, saved in zip(eoptimizer.param_groups, prep["opt_state"]["param_groups"]):
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    own[k] = _from_json(v, own.get(k))
        scaler_state = prep["opt_state"].get("loss_scaler")
        if eoptimizer.scaler is not None and scaler_state:
            eoptimizer.scaler.load_state_dict(scaler_state)
        eoptimizer.zero_grad()
    if scheduler is not None:
        scheduler.load_state_dict(prep["sched_state"])
    emodel.release_all()
    return {"path": str(prep["path"]), "world_size": index["world_size"],
            "resharded": index["world_size"] != emodel.comm.world_size or index["plan_digest"] != emodel.plan.digest(),
            "extra": prep["extra"] or {}}
