"""ElixirPlan: the versioned record of every memory decision the runtime executes.

The planner (``hf_elixir.planner.search``) produces plans; the runtime (``hf_elixir.runtime``)
only reads them. Keeping the plan a plain, JSON-serialisable dataclass means a plan can be
made on a laptop for hardware one does not have, inspected, edited, stored beside a
checkpoint and replayed exactly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

import torch
from torch import nn

from hf_elixir import vocab
from hf_elixir.planner.summary import summary as _summary
from hf_elixir.profile.needs import trace_fetch_needs
from hf_elixir.profile.params import chunk_numel, chunked_parameters, detect_fetch_units, model_signature
from hf_elixir.vocab import DTYPES, HfElixirError

PLAN_FORMAT_VERSION = 1

Placement = Literal["device", "cpu", "disk"]
_PLACEMENTS = ("device", "cpu")
#: a trainable chunk's fp32 master and optimizer state may also live in files on a disk
#: (the runtime's disk tier, ``runtime/disk_tier.py``); parameter shards may not
_OPTIM_PLACEMENTS = ("device", "cpu", "disk")

#: what a block does with the activations its backward needs (see ElixirPlan.block_policies):
#: keep them on the device; recompute them from the block's input (checkpointing); recompute
#: them from an input that waits in host memory; or keep them all, in host memory
BlockPolicy = Literal["keep", "recompute", "recompute_offload", "offload"]
BLOCK_POLICIES: tuple[str, ...] = ("keep", "recompute", "recompute_offload", "offload")


class PlanError(HfElixirError, ValueError):
    """A plan is invalid for this model, or no plan fits the memory available."""


def canonical_dtype(dtype: str | torch.dtype) -> str:
    """The plan's spelling ("float32", "bfloat16", "float16") of a dtype or alias."""
    return vocab.canonical_dtype(dtype, PlanError)


#: parameter offsets inside a chunk (and shard boundaries) are multiples of this many bytes,
#: so every parameter view starts where vectorised kernels want it to
ALIGN_BYTES = 16


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def chunk_layout(numels: Iterable[int], itemsize: int, world_size: int) -> tuple[int, list[int]]:
    """How the runtime lays out one chunk: (its size in elements, each parameter's offset).

    Offsets are ``ALIGN_BYTES``-aligned and the size a multiple of W alignments, so shard
    boundaries are aligned too. A chunk is as large as its contents plus this padding, not
    the plan's chunk_size. The planner's byte predictions use the same function, so the
    padding it predicts is the padding the runtime moves."""
    align = max(1, ALIGN_BYTES // itemsize)
    offsets, end = [], 0
    for n in numels:
        offsets.append(_round_up(end, align))
        end = offsets[-1] + n
    return _round_up(end, align * world_size), offsets


@dataclass
class ChunkPlan:
    """One chunk: the parameters it packs, in order, and where its state lives.

    A *frozen* chunk packs parameters that need no gradient: it holds only compute-dtype
    shards (no fp32 master, no gradient buffer, no reduce-scatter, no optimizer state), so
    ``optim_placement`` means nothing for it; ``param_placement="cpu"`` offloads its shards.
    ``optim_placement="disk"`` keeps a trainable chunk's fp32 master and optimizer state in
    files under the run's ``nvme_path`` (the disk tier), updated on the host.
    """

    params: list[str]
    optim_placement: Placement = "device"
    param_placement: Placement = "device"
    numel: int = 0  # elements of its parameters (0: not recorded); may exceed chunk_size
                    # only for a chunk holding one large parameter
    frozen: bool = False


@dataclass
class ElixirPlan:
    """Everything the runtime needs to shard, cache and offload one model.

    Attributes:
        world_size: number of ranks the chunks are sharded over.
        chunk_size: elements per chunk (every chunk has this capacity; divisible by world_size).
        chunks: the chunks in fetch order, each a list of parameter names.
        compute_dtype: dtype of parameters in forward/backward ("float32", "bfloat16", "float16").
        rcache_blocks: device blocks of chunk_size elements that hold gathered chunks.
        activation_checkpointing: recompute activations in backward.
        prefetch_depth: how many upcoming chunks are gathered ahead of use.
        fetch_units: module names whose whole subtree is fetched as one unit (dynamic control
            flow inside, e.g. mixture-of-experts blocks), so that every rank issues the same
            collectives whatever its routing.
        borrowed: module name -> parameters its forward reads without owning them
            (``self.child.weight`` read by the parent); the runtime fetches them for it too.
        min_rcache_blocks: the fewest rCache blocks this model and packing can run with (the
            most chunks in use at once, from the traced step); 0 when unknown.
        signature: digest of the chunked parameters' names, shapes and frozen flags (see
            model_signature).
        micro_batch_split: how many micro-batches each batch the script hands the model is
            run as (an integration that can split batches, the Trainer's, honours it; the
            global batch stays the same). 1 unless a recovery or ``auto_find_batch_size``
            chose a smaller micro-batch.
        block_policies: block (module name) -> its activation policy, one of BLOCK_POLICIES.
            Empty: every block follows ``activation_checkpointing`` ("recompute" when it is
            on, "keep" when off). A block not named keeps that default too.
        logit_piece_tokens: the LM head and its loss run over the sequence in pieces of this
            many tokens, so the whole (batch, sequence, vocab) logits never exist; 0 runs
            them whole, as the model does.
        mlp_tiles: each block's MLP (its position-wise sublayer) runs over the sequence in this
            many tiles, each checkpointed, so that one tile's intermediate (sequence/tiles x
            intermediate size) exists at a time instead of the whole; 1 runs it whole
            (runtime/mlp_tiles.py).
        predictions: optional figures from the planner (peak bytes by category, step time).
        alternatives: optional runner-up candidates with the reason they lost.
    """

    world_size: int
    chunk_size: int
    chunks: list[ChunkPlan]
    compute_dtype: str = "float32"
    rcache_blocks: int = 0
    activation_checkpointing: bool = False
    prefetch_depth: int = 1
    fetch_units: list[str] = field(default_factory=list)
    borrowed: dict[str, list[str]] = field(default_factory=dict)
    min_rcache_blocks: int = 0
    signature: str = ""
    micro_batch_split: int = 1
    block_policies: dict[str, str] = field(default_factory=dict)
    logit_piece_tokens: int = 0
    mlp_tiles: int = 1
    predictions: dict[str, Any] = field(default_factory=dict)
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    version: int = PLAN_FORMAT_VERSION

    # ------------------------------------------------------------------ derived views
    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.compute_dtype]

    @property
    def shard_size(self) -> int:
        return self.chunk_size // self.world_size

    def param_names(self) -> list[str]:
        return [name for chunk in self.chunks for name in chunk.params]

    def offload_fraction(self) -> float:
        """Fraction of trainable chunks whose optimizer state is off the device (in host memory
        or on the disk tier, whose chunks are updated on the host too)."""
        trainable = [c for c in self.chunks if not c.frozen]
        if not trainable:
            return 0.0
        return sum(c.optim_placement != "device" for c in trainable) / len(trainable)

    def policy_of(self, block: str) -> str:
        """The activation policy of ``block``: its entry in block_policies, or the default
        that ``activation_checkpointing`` sets for every block."""
        return self.block_policies.get(block, "recompute" if self.activation_checkpointing else "keep")

    @property
    def frozen_chunks(self) -> list[int]:
        """Indices of the chunks that hold frozen parameters."""
        return [i for i, c in enumerate(self.chunks) if c.frozen]

    # ------------------------------------------------------------------ construction
    @classmethod
    def simple(
        cls,
        model: nn.Module,
        world_size: int = 1,
        chunk_size: int | None = None,
        rcache_blocks: int | None = None,
        offload_fraction: float = 0.0,
        offload_params: bool = False,
        offload_frozen: float = 0.0,
        compute_dtype: str | torch.dtype = "float32",
        activation_checkpointing: bool = False,
        prefetch_depth: int = 1,
        fetch_units: list[str] | None = None,
        pack_size: int | None = None,
        example_batch: Any = (1, 16),
    ) -> "ElixirPlan":
        """A valid plan without search: parameters packed greedily in module order.

        chunk_size defaults to the largest parameter (rounded up to a multiple of world_size);
        a parameter larger than chunk_size gets a chunk of its own, sized to it. One step
        of a meta-device copy of the model with ``example_batch`` (a dict of tensors, only
        their shapes are used, or ``(batch_size, seq_len)`` of ``input_ids``) finds the
        parameters a module reads without owning them and the fewest rCache blocks the
        model needs; rcache_blocks defaults to every chunk (nothing is ever re-gathered) and
        a value below that minimum is refused. The last
        ``offload_fraction`` of chunks keep their optimizer state on the CPU (the first
        chunks are used first in backward's last stretch, so offloading the tail first
        overlaps best); ``offload_params`` also places those chunks' parameter shards on CPU.
        ``pack_size`` (default chunk_size) fills chunks only up to that many elements: a
        parameter larger than it gets a chunk of its own, so a huge embedding does not force
        every chunk to its size. Smaller chunks overlap communication with compute better.

        Frozen parameters (``requires_grad=False``) are packed into frozen chunks of their
        own, in the same module order; ``offload_fraction`` counts trainable chunks only,
        and ``offload_frozen`` places the last fraction of frozen chunks' shards in CPU
        memory (read-only there: they are uploaded, never written back).
        """
        if world_size < 1:
            raise PlanError(f"world_size must be >= 1, got {world_size}")
        for label, value in (("offload_fraction", offload_fraction), ("offload_frozen", offload_frozen)):
            if not 0.0 <= value <= 1.0:
                raise PlanError(f"{label} must be within [0, 1], got {value}")
        named = chunked_parameters(model)
        if not any(p.requires_grad for _, p in named):
            raise PlanError(
                "the model has no floating-point parameters that require gradients, so there is "
                "nothing to train; unfreeze some (or add an adapter) before planning"
            )
        # elements as the runtime lays them out: a packed 4-bit weight by its bytes
        itemsize = DTYPES[canonical_dtype(compute_dtype)].itemsize
        sizes = {name: chunk_numel(p, itemsize) for name, p in named}
        if chunk_size is None:
            chunk_size = max(sizes.values())
        if chunk_size < 1:
            raise PlanError(f"chunk_size must be >= 1, got {chunk_size}")
        chunk_size = -(-chunk_size // world_size) * world_size
        fill = chunk_size if pack_size is None else min(max(pack_size, 1), chunk_size)
        groups: list[list[str]] = []
        kinds: list[bool] = []  # frozen?
        used = chunk_size
        for name, p in named:
            frozen = not p.requires_grad
            if sizes[name] > chunk_size:  # alone in a chunk of its own size
                groups.append([name])
                kinds.append(frozen)
                used = chunk_size
                continue
            # a new chunk when this one is full or holds the other kind (a zero-size
            # parameter opens one too)
            if not groups or used + sizes[name] > fill or kinds[-1] != frozen:
                groups.append([])
                kinds.append(frozen)
                used = 0
            groups[-1].append(name)
            used += sizes[name]
        trainable_ids = [i for i, k in enumerate(kinds) if not k]
        frozen_ids = [i for i, k in enumerate(kinds) if k]
        optim_off = set(trainable_ids[len(trainable_ids) - round(len(trainable_ids) * offload_fraction):])
        frozen_off = set(frozen_ids[len(frozen_ids) - round(len(frozen_ids) * offload_frozen):])
        contents = [sum(sizes[name] for name in g) for g in groups]
        _warn_unhonoured_offload("offload_fraction", offload_fraction, trainable_ids, optim_off, contents)
        _warn_unhonoured_offload("offload_frozen", offload_frozen, frozen_ids, frozen_off, contents)
        chunks = [
            ChunkPlan(
                params=g,
                optim_placement="cpu" if i in optim_off else "device",
                param_placement="cpu" if (offload_params and i in optim_off) or i in frozen_off else "device",
                numel=sum(sizes[name] for name in g),
                frozen=kinds[i],
            )
            for i, g in enumerate(groups)
        ]
        if fetch_units is None:
            fetch_units = detect_fetch_units(model)
        needs = _trace_needs(model, example_batch, fetch_units, activation_checkpointing)
        minimum = needs.rcache_minimum(groups)
        if rcache_blocks is not None and rcache_blocks < minimum:
            raise PlanError(_too_few_blocks(rcache_blocks, minimum))
        return cls(
            world_size=world_size,
            chunk_size=chunk_size,
            chunks=chunks,
            compute_dtype=canonical_dtype(compute_dtype),
            rcache_blocks=len(chunks) if rcache_blocks is None else rcache_blocks,
            activation_checkpointing=activation_checkpointing,
            prefetch_depth=prefetch_depth,
            fetch_units=fetch_units,
            borrowed=needs.borrowed,
            min_rcache_blocks=minimum,
            signature=model_signature(named),
        )

    # ------------------------------------------------------------------ validation
    def validate(self, model: nn.Module | None = None, world_size: int | None = None) -> None:
        """Raise PlanError, saying what to change, if this plan cannot run (on this model)."""
        if self.version > PLAN_FORMAT_VERSION:
            raise PlanError(
                f"plan format version {self.version} is newer than this hf_elixir understands "
                f"({PLAN_FORMAT_VERSION}); upgrade hf_elixir"
            )
        if self.world_size < 1:
            raise PlanError(f"world_size must be >= 1, got {self.world_size}")
        if self.chunk_size <= 0 or self.chunk_size % self.world_size:
            raise PlanError(
                f"chunk_size {self.chunk_size} is not a positive multiple of the world size "
                f"{self.world_size}; round it up to {-(-max(self.chunk_size, 1) // self.world_size) * self.world_size}"
            )
        if world_size is not None and world_size != self.world_size:
            raise PlanError(
                f"the plan was made for world size {self.world_size} but the process group has "
                f"{world_size} ranks; make a plan for {world_size} ranks"
            )
        canonical_dtype(self.compute_dtype)
        if self.rcache_blocks < 1:
            raise PlanError(f"rcache_blocks must be >= 1, got {self.rcache_blocks}")
        odd = {b: p for b, p in self.block_policies.items() if p not in BLOCK_POLICIES}
        if odd:
            raise PlanError(f"block_policies has unknown policies {odd}; each must be one of {BLOCK_POLICIES}")
        if self.logit_piece_tokens < 0:
            raise PlanError(f"logit_piece_tokens must be >= 0 (0: whole logits), got {self.logit_piece_tokens}")
        if isinstance(self.mlp_tiles, bool) or not isinstance(self.mlp_tiles, int) or self.mlp_tiles < 1:
            raise PlanError(f"mlp_tiles must be an int >= 1 (1: the MLP runs whole), got {self.mlp_tiles!r}")
        if self.rcache_blocks < self.min_rcache_blocks:
            raise PlanError(_too_few_blocks(self.rcache_blocks, self.min_rcache_blocks))
        if self.prefetch_depth < 0:
            raise PlanError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.micro_batch_split < 1:
            raise PlanError(f"micro_batch_split must be >= 1, got {self.micro_batch_split}")
        for i, c in enumerate(self.chunks):
            if c.optim_placement not in _OPTIM_PLACEMENTS or c.param_placement not in _PLACEMENTS:
                raise PlanError(f"chunk {i}: optim_placement must be one of {_OPTIM_PLACEMENTS} and "
                                f"param_placement one of {_PLACEMENTS}")
        seen: dict[str, int] = {}
        for i, c in enumerate(self.chunks):
            if not c.params:
                raise PlanError(f"chunk {i} is empty; remove it from the plan")
            for name in c.params:
                if name in seen:
                    raise PlanError(
                        f"parameter {name!r} appears twice in the plan (chunks {seen[name]} and {i}); "
                        "each parameter must be in exactly one chunk"
                    )
                seen[name] = i
        if model is None:
            return
        named = dict(chunked_parameters(model))
        missing = [n for n in seen if n not in named]
        if missing:
            raise PlanError(
                f"the plan names parameters the model does not have: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; the plan was made for another model: "
                "make a new plan for this one"
            )
        absent = [n for n in named if n not in seen]
        if absent:
            raise PlanError(
                f"the plan leaves out parameters {absent[:5]}"
                f"{' ...' if len(absent) > 5 else ''}; make a new plan for this model (plans "
                "hold frozen parameters too, in frozen chunks)"
            )
        for i, c in enumerate(self.chunks):
            wrong = [n for n in c.params if named[n].requires_grad == c.frozen]
            if wrong:
                now = "requires" if c.frozen else "does not require"
                raise PlanError(
                    f"parameter {wrong[0]!r} {now} grad but the plan holds it in a "
                    f"{'frozen' if c.frozen else 'trainable'} chunk ({i}): the model was frozen or "
                    "unfrozen after planning; make the plan after setting requires_grad"
                )
        if self.signature and self.signature != model_signature(chunked_parameters(model)):
            raise PlanError(
                "the plan was made for a model whose parameter shapes differ from this one; "
                "make a new plan for this model"
            )
        for i, c in enumerate(self.chunks):
            total = sum(chunk_numel(named[n], self.dtype.itemsize) for n in c.params)
            if total > self.chunk_size and len(c.params) > 1:  # one large parameter may
                raise PlanError(
                    f"chunk {i} holds {total} elements, more than chunk_size {self.chunk_size}; "
                    "raise chunk_size or split the chunk (only a single parameter may exceed it)"
                )
        modules = dict(model.named_modules())
        unknown = [u for u in [*self.fetch_units, *self.borrowed] if u not in modules]
        if unknown:
            raise PlanError(f"fetch_units or borrowed name modules the model does not have: {unknown}")
        strangers = [p for ps in self.borrowed.values() for p in ps if p not in named]
        if strangers:
            raise PlanError(f"borrowed names parameters the model does not have: {strangers[:5]}")

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ElixirPlan":
        data = dict(data)
        version = int(data.get("version", PLAN_FORMAT_VERSION))
        if version > PLAN_FORMAT_VERSION:
            raise PlanError(
                f"plan format version {version} is newer than this hf_elixir understands "
                f"({PLAN_FORMAT_VERSION}); upgrade hf_elixir"
            )
        data["chunks"] = [ChunkPlan(**c) for c in data.get("chunks", [])]
        known = set(cls.__dataclass_fields__)
        extra = set(data) - known
        if extra:
            raise PlanError(f"unknown plan fields {sorted(extra)}")
        return cls(**data)

    def to_json(self, path: str | Path | None = None, indent: int = 1) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "ElixirPlan":
        """Read a plan from a JSON string or from a file path."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))

    def summary(self) -> str:
        """A table explaining the choice: predictions by category and the runners-up."""
        return _summary(self)

    def digest(self) -> str:
        """Digest of the decisions (not the predictions): equal digests shard identically."""
        core = self.to_dict()
        core.pop("predictions", None)
        core.pop("alternatives", None)
        core.pop("micro_batch_split", None)  # how batches are split does not change the sharding
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]


def _too_few_blocks(blocks: int, minimum: int) -> str:
    return (
        f"rcache_blocks {blocks} is too few for this model and packing: up to {minimum} chunks "
        f"are in use at once (nested modules, several chunks per module); use "
        f"rcache_blocks >= {minimum} (or a larger chunk_size, so modules span fewer chunks)"
    )


def _trace_needs(model: nn.Module, example_batch: Any, fetch_units: list[str], checkpointing: bool):
    """``trace_fetch_needs`` with its failure turned into advice."""
    try:
        return trace_fetch_needs(model, example_batch, fetch_units, checkpointing)
    except Exception as exc:
        raise PlanError(
            f"could not trace one step of {type(model).__name__} on the meta device "
            f"({type(exc).__name__}: {exc}); pass example_batch= with inputs its forward "
            "accepts (a dict of tensors)"
        ) from exc


def _warn_unhonoured_offload(label: str, asked: float, ids: list[int], chosen: set[int],
                             chunk_numel: list[int]) -> None:
    """Warn when whole-chunk offloading lands far from the fraction asked for.

    Chunks are offloaded whole, so a fraction is rounded to a number of chunks; with few
    chunks that can mean nothing at all (0.5 of a model packed into one chunk) or everything.
    Silence would leave the user believing the memory was saved."""
    if not ids or asked in (0.0, 1.0):
        return
    total = sum(chunk_numel[i] for i in ids)
    got = sum(chunk_numel[i] for i in chosen) / total if total else 0.0
    if (got == 0.0 or got == 1.0 or abs(got - asked) > 0.25):
        import warnings

        warnings.warn(
            f"{label}={asked:g} cannot be honoured: chunks are offloaded whole, and {len(chosen)} of the "
            f"{len(ids)} chunk(s) it applies to ({got:.0%} of their elements) are offloaded. Pin a smaller "
            "chunk size (chunk_size_mb) to offload at a finer grain, or ask for 0 or 1",
            UserWarning, stacklevel=3,
        )
