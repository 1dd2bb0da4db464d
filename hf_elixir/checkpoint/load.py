"""Load a sharded checkpoint into a runtime of any world size and plan.

Everything is checked before anything changes (the index, the model's names and shapes, the
frozen weights' digests, the optimizer's kind and groups, every file's size and sha256 (the
small JSON files' always, the tensor files' unless ``verify=False``), the safetensors
headers); on any problem every rank raises the same ``CheckpointError``; an unexpected
exception on one rank is re-raised there and reaches the others as a ``CheckpointError``. Then
each rank fills the slices it owns now from the saved slices that overlap them
(``reshard.py``), through the runtime's seam (``hf_elixir.runtime.state``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from hf_elixir.checkpoint import frozen as frz
from hf_elixir.checkpoint.common import LocalPart, agree, frozen_digests, from_json_value, whole_tensors
from hf_elixir.checkpoint.errors import CheckpointError
from hf_elixir.checkpoint.index import EXTRA_NAME, INDEX_NAME, OPTIMIZER_STATE_NAME, SCHEDULER_NAME, UNTRACKED_NAME, resolve, verify_hashes
from hf_elixir.checkpoint.io import SafetensorsReader, dtype_name
from hf_elixir.checkpoint.names import member
from hf_elixir.checkpoint.reshard import SavedSlices
from hf_elixir.runtime import state


def _check_model(emodel, index: dict, path: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint must hold exactly this model's tensors with these shapes, and the same
    ones frozen (their values are checked by digest later, collectively)."""
    where = path / INDEX_NAME
    saved_frozen = frz.SavedFrozen.from_index(index, str(where))
    saved = {p["name"]: tuple(p["shape"]) for p in index["params"]}
    saved.update({u["name"]: tuple(u["shape"]) for u in index.get("untracked", [])})
    if saved_frozen is not None:
        saved.update({n: r.shape for n, r in saved_frozen.records.items()})
    own = state.parameter_shapes(emodel)
    untracked, _ = whole_tensors(emodel)
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


def _checkfrozen_digests(emodel, index: dict, path: Path, dtype: torch.dtype) -> None:
    """Collective: compute this model's frozen digests and refuse (on every rank: the digests
    are the same everywhere) when they are not the checkpoint's. Changes nothing."""
    where = str(path / INDEX_NAME)
    saved = frz.SavedFrozen.from_index(index, where)
    own = frozen_digests(emodel, [dtype])
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
    own_names = state.state_names(eoptimizer)
    if sorted(meta["state_names"]) != sorted(own_names):
        raise CheckpointError(f"{where}: optimizer state holds {meta['state_names']}, this optimizer "
                              f"keeps {own_names} (momentum on/off?); create the optimizer as it was")
    groups = opt_state["param_groups"]
    own_groups = state.group_parameter_names(eoptimizer)
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
    # this rank's checks, then one agreement: an exception of any type on one rank makes
    # every rank raise here (common.agree), none waits in a collective forever
    part = LocalPart.run(_prepare_load, emodel, eoptimizer, scheduler, Path(directory).absolute(), verify)
    prepared = part.value
    try:
        agree(emodel.comm, part, f"loading {directory}")
        if prepared["frozen_dtype"] is not None:  # the same on every rank: read from one index
            _checkfrozen_digests(emodel, prepared["index"], prepared["path"], prepared["frozen_dtype"])
    except BaseException:
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
    source = SavedSlices(path, index)
    try:
        # which files this rank reads
        needed: set[str] = {UNTRACKED_NAME}
        for s in state.local_slices(emodel, frozen=True):
            needed.update(source.files_for(s.name, s.begin, s.end, "model"))
            if eoptimizer is not None:
                needed.update(source.files_for(s.name, s.begin, s.end, "optimizer"))
        if verify:
            verify_hashes(path, index, sorted(needed))
        for fname in sorted(needed):  # headers parse, keys present with the recorded sizes
            reader = source.reader(fname)
            _check_keys(reader, fname, index, eoptimizer)
        counters = state.OptimizerCounters()
        if eoptimizer is not None:
            for s in state.local_slices(emodel):
                counters.steps[s.name] = source.step(s.name) if s.name in source.params else 0.0
            for fname in sorted(needed):
                if fname.startswith("optimizer-"):
                    counters.momentum_started.update(
                        json.loads(source.reader(fname).metadata.get("momentum_started", "[]")))
    except BaseException:
        source.close()
        raise
    return {"path": path, "index": index, "source": source, "untracked": untracked, "frozen_dtype": frozen_dtype,
            "opt_state": opt_state, "sched_state": sched_state, "extra": extra, "counters": counters}


def _read_json(path: Path, name: str, index: dict) -> Any:
    """A small JSON file of the checkpoint, checked against the size and sha256 the index
    records (always: it is read whole anyway, and a same-size change would silently alter
    the learning rate, the betas or the schedule on resume). The bytes hashed are the bytes
    parsed."""
    if name not in index["files"]:
        raise CheckpointError(f"{path}: the index lists no {name}; the checkpoint is corrupted")
    fpath = member(path, name, str(path / INDEX_NAME))
    data = fpath.read_bytes()
    info = index["files"][name]
    if len(data) != info["size"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CheckpointError(f"{fpath}: contents do not match the size and sha256 recorded in the index; the "
                              "file is corrupted or was edited: restore it, or load an earlier checkpoint")
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{fpath}: not valid JSON ({e}); the file is corrupted") from None


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
    source: SavedSlices = prep["source"]
    index = prep["index"]
    state.release_all(emodel)
    for piece in state.chunk_slices(emodel, frozen=True, write=True):  # one chunk at a time
        for s in piece:
            if s.frozen and s.name not in source.untracked:
                continue  # not stored: the model's own values (checked by digest) stay
            source.read(s.name, s.begin, s.end, s.master)
    state.publish_masters(emodel)
    for name, tensor in prep["untracked"]:
        buf = torch.empty(tensor.numel(), dtype=torch.float32) if tensor.is_floating_point() else None
        if name in source.params:
            source.read(name, 0, tensor.numel(), buf)
            tensor.data.copy_(buf.view(tensor.shape))
        else:
            tensor.data.copy_(source.reader(UNTRACKED_NAME).read_tensor(name))
    if eoptimizer is not None:
        state_names = index["optimizer"]["state_names"]
        for piece in state.chunk_slices(emodel, eoptimizer, write=True):
            for s in piece:
                saved = s.name in source.params
                for sname in state_names:
                    if saved:
                        source.read(s.name, s.begin, s.end, s.state[sname], state=sname)
                    else:
                        s.state[sname].zero_()
        state.write_counters(eoptimizer, prep["counters"])
        for own, saved in zip(eoptimizer.param_groups, prep["opt_state"]["param_groups"]):
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    own[k] = from_json_value(v, own.get(k))
        scaler_state = prep["opt_state"].get("loss_scaler")
        if eoptimizer.scaler is not None and scaler_state:
            eoptimizer.scaler.load_state_dict(scaler_state)
        eoptimizer.zero_grad()
    if scheduler is not None:
        scheduler.load_state_dict(prep["sched_state"])
    state.release_all(emodel)
    return {"path": str(prep["path"]), "world_size": index["world_size"],
            "resharded": index["world_size"] != emodel.comm.world_size or index["plan_digest"] != emodel.plan.digest(),
            "extra": prep["extra"] or {}}
