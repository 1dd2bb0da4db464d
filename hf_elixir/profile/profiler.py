"""``profile_model``: one traced forward+backward on the meta device, with and without
activation checkpointing, giving everything the planner needs to know about the model."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from hf_elixir.profile import fold as folding
from hf_elixir.profile.forked import forked_map
from hf_elixir.profile.lora import decoder_blocks
from hf_elixir.profile.params import chunk_numel, chunked_parameters, detect_fetch_units
from hf_elixir.profile.quant import packed_weights, quant_state_bytes
from hf_elixir.vocab import DTYPE_BYTES, canonical_dtype
from hf_elixir.profile.memory import LiveStorageTracker, StepMemory, run_step
from hf_elixir.profile.trace import (
    EventWork,
    ExecutionTracer,
    Trace,
    batch_shape,
    build_meta_model,
    find_borrowed_reads,
    make_batch,
    own_meta_model,
    module_parameters,
    set_training,
    tied_parameters,
)


logger = logging.getLogger(__name__)

@dataclass
class ParamInfo:
    """One chunked parameter. ``frozen``: it needs no gradient, so it goes to a frozen chunk
    (compute-dtype shards only: no master, gradient or optimizer state)."""

    name: str
    numel: int
    shape: tuple[int, ...]
    frozen: bool = False
    #: a packed 4-bit weight (QLoRA's base): how many weights its bytes hold; ``numel`` is
    #: then those bytes counted in compute-dtype elements, as its chunk holds them
    packed_weights: int = 0


@dataclass
class PassProfile:
    """One traced step: its fetch trace and its activation memory."""

    trace: Trace
    memory: StepMemory


@dataclass
class ModelProfile:
    """What the planner knows about a model and a batch shape.

    Attributes:
        params: every chunked parameter (``plan.chunked_parameters``: floating-point, tied
            ones once), in ``named_parameters`` order; frozen ones (``requires_grad=False``)
            are flagged, since the runtime packs them into frozen chunks that it shards like
            the rest but holds no training state for.
        tied: groups of names that are one parameter.
        buffer_bytes: bytes every rank holds whole: buffers, parameters that are not
            floating-point (8-bit quantised storage is never chunked) and the quantisation
            state of packed 4-bit weights (whose packed bytes are chunked).
        fetch_units: modules fetched as one unit (mixture-of-experts blocks).
        borrowed: module -> parameters its forward reads without owning them (fetched for
            it too; see ``find_borrowed_reads``).
        plain: the step without activation checkpointing.
        checkpointed: the step with activation checkpointing, or None when the model does not
            support it.
        batch_size, seq_len: the profiled (per-rank) batch shape.
        dtype: the compute dtype the memory was measured in.
        attention_target: which device's attention kernels were assumed ("cpu"/"cuda").
        seconds: how long profiling took.
    """

    params: list[ParamInfo]
    tied: list[list[str]]
    buffer_bytes: int
    fetch_units: list[str]
    plain: PassProfile
    checkpointed: PassProfile | None
    batch_size: int
    seq_len: int
    dtype: str
    attention_target: str
    model_name: str = ""
    seconds: float = 0.0
    borrowed: dict[str, list[str]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def trainable(self) -> list[ParamInfo]:
        return [p for p in self.params if not p.frozen]

    @property
    def frozen(self) -> list[ParamInfo]:
        return [p for p in self.params if p.frozen]

    @property
    def n_params(self) -> int:
        """Trainable parameters (elements)."""
        return sum(p.numel for p in self.trainable)

    @property
    def n_frozen_params(self) -> int:
        """Frozen parameters (weights): a PEFT base, frozen layers or embeddings; a 4-bit
        base counts its weights, not its bytes."""
        return sum(p.packed_weights or p.numel for p in self.frozen)

    @property
    def n_packed_params(self) -> int:
        """Frozen weights held packed in 4 bits (QLoRA's base)."""
        return sum(p.packed_weights for p in self.frozen)

    @property
    def frozen_bytes(self) -> int:
        """Bytes of the frozen parameters as chunks hold them (the compute dtype; a 4-bit
        base its packed bytes): what one rank would hold if they were replicated, and what
        the ranks' frozen shards add up to (less padding)."""
        return sum(p.numel for p in self.frozen) * DTYPE_BYTES[self.dtype]

    @property
    def hidden_size(self) -> int | None:
        """The model's width, read from its weights rather than its config (whose field names
        vary): the most common smaller side of its trainable matrices, since every projection
        of a transformer block has the hidden size on one side. None without matrices.

        With frozen parameters the smaller side shared by most matrix *elements*, frozen ones
        included, is taken instead: LoRA adapters (rank x width, two per adapted projection)
        outnumber the base's matrices and would pass the rank off as the width, while the
        base's matmuls are most of the compute. (Full fine-tunes keep the count, so their
        plans are what they were.)"""
        sides: Counter[int] = Counter()
        weighted = bool(self.frozen)
        for p in self.params if weighted else self.trainable:
            if len(p.shape) == 2:
                sides[min(p.shape)] += p.numel if weighted else 1
        if not sides:
            return None
        return max(sides.items(), key=lambda kv: (kv[1], kv[0]))[0]

    @property
    def largest_param(self) -> ParamInfo:
        return max(self.params, key=lambda p: p.numel)

    def step(self, checkpointing: bool) -> PassProfile:
        if checkpointing:
            if self.checkpointed is None:
                raise ValueError("this model does not support activation checkpointing")
            return self.checkpointed
        return self.plain

    def activation_peak(self, checkpointing: bool) -> int:
        """Peak bytes of activations and temporaries over the step."""
        return self.step(checkpointing).memory.peak

    def param_order(self) -> list[str]:
        """Chunked parameters, trainable and frozen, in forward first-use order (the packing
        order of each kind)."""
        return self.plain.trace.first_use_order(p.name for p in self.params)

    def summary(self) -> str:
        gib = 2**30
        frozen = f" + {self.n_frozen_params / 1e6:.1f}M frozen" if self.n_frozen_params else ""
        lines = [
            f"model {self.model_name}: {self.n_params / 1e6:.1f}M trainable{frozen} parameters, "
            f"batch {self.batch_size} x {self.seq_len}, {self.dtype}",
            f"  activations+temporaries peak: {self.plain.memory.peak / gib:.3f} GiB without "
            "checkpointing"
            + (
                f", {self.checkpointed.memory.peak / gib:.3f} GiB with"
                if self.checkpointed is not None else " (checkpointing unsupported)"
            ),
            f"  step FLOPs: {self.plain.memory.flops / 1e12:.2f} TFLOP; profiled in {self.seconds:.2f} s",
        ]
        return "\n".join(lines)


def _supports_checkpointing(model: nn.Module) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and (
        hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")
    )


def model_checkpoints(model: nn.Module) -> bool:
    """Whether the model's own activation checkpointing is already on: the user, or the
    Trainer's ``--gradient_checkpointing``, turned it on before hf_elixir saw the model. Such
    a model checkpoints whatever a plan says, so plans must be priced, and labelled, that way."""
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(model, attr, None)
        if isinstance(value, bool):
            return value
    return False


def enable_checkpointing(model: nn.Module, **options: Any) -> None:
    """Turn on the model's own (non-reentrant) activation checkpointing, under whichever name
    the installed Transformers gives it: ``activation_checkpointing_enable`` from about 5.2x
    on, ``gradient_checkpointing_enable`` before (later a deprecated alias). ``options``
    (``every_n_layers``, ...) go to that method as they are."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **options)


def disable_checkpointing(model: nn.Module) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    elif hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector paused for one traced step: the tracer collects young cycles
    at every fetch event instead (``ExecutionTracer.collect``). Tensors caught in reference
    cycles (activation checkpointing's holders, a mixture of experts' routing) otherwise die
    whenever the collector happens to run, which made the live bytes of a trace differ from
    one run to the next; collected at each event, they die at the same instants every run,
    as soon after they become garbage as a real run's would, and every layer's trace looks
    alike, which folding needs."""
    was = gc.isenabled()
    gc.disable()  # no full collection first: storages made before the step are not counted
    try:
        yield
    finally:
        if was:
            gc.enable()


def trace_step(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    fetch_units: list[str],
    attention_target: str | None,
    borrowed: dict[str, list[str]] | None = None,
) -> PassProfile:
    """Run one step of ``model`` (meta or real) under the tracer and the storage tracker."""
    tracer = ExecutionTracer(model, fetch_units, borrowed)
    tracer.collect = True
    tracker = LiveStorageTracker()
    tracker.on_flops = tracer.add_flops
    tracker.on_op = tracer.add_op
    tracer.tracker = tracker

    def backward_begins():
        tracer.in_backward = True

    with tracer, _collector_paused():
        mem = run_step(model, batch, attention_target=attention_target,
                       on_backward_start=backward_begins, tracker=tracker)
    trace = tracer.trace
    # a module whose output never received a gradient is still fetched for its backward
    seen_bwd = {m for ph, m in trace.events if ph == "backward"}
    fwd = [m for ph, m in trace.events if ph == "forward"]
    for m in reversed(list(dict.fromkeys(fwd))):
        if m not in seen_bwd:
            trace.events.append(("backward", m))
            trace.work.append(EventWork())
            trace.live.append(trace.live[-1] if trace.live else (0, 0))
    return PassProfile(trace=trace, memory=mem)


def profile_model(
    model_or_config: Any,
    example_batch: dict[str, torch.Tensor] | tuple[int, int],
    dtype: str | torch.dtype = "float32",
    attention_target: str = "cuda",
    checkpointing: bool | None = None,
    model_name: str = "",
    build: Callable[[Any], nn.Module] | None = None,
    fold: bool = True,
    workers: int = 1,
) -> ModelProfile:
    """Profile one training step of a model on the meta device.

    Args:
        model_or_config: an ``nn.Module`` (never modified, never copied in real memory) or a
            transformers config (``AutoModelForCausalLM.from_config`` on meta).
        example_batch: a dict of tensors (only shapes and dtypes are used) or
            ``(batch_size, seq_len)``; this is the per-rank micro-batch.
        dtype: compute dtype of parameters and activations.
        attention_target: "cuda" or "cpu": which device's fused attention kernels to assume.
        checkpointing: profile only without (False) or only with (True) checkpointing;
            None profiles both.
        build: with a config, what makes the meta model from it (a LoRA or 4-bit fine-tune
            of the config's model, say); default ``build_meta_model``. It is called on
            shortened copies of the config when the profile is folded.
        fold: profile a deep model from a few of its layers (``profile.fold``) when its
            layers repeat exactly; False traces every layer.
        workers: with 2 or more, a folded profile's two depths are traced side by side in a
            forked process (``profile.forked``: only for a process with no threads of its own).
    """
    start = time.perf_counter()
    dtype = canonical_dtype(dtype)
    is_config = not isinstance(model_or_config, nn.Module)
    if build is not None and not is_config:
        raise TypeError("build= makes a model from a config; pass the config, not a module")

    def make(config: Any) -> nn.Module:
        # a built model gets its floating parameters in the compute dtype, as a copied one does
        return own_meta_model(build(config), dtype) if build else build_meta_model(config, dtype)

    def profile_of(meta: nn.Module) -> ModelProfile:
        return _profile_meta(set_training(meta, True), example_batch, dtype, attention_target, checkpointing)

    profile = _folded(model_or_config, is_config, make, dtype, profile_of, workers) if fold else None
    if profile is None:
        meta = make(model_or_config) if is_config else set_training(build_meta_model(model_or_config, dtype))
        profile = profile_of(meta)
    if not model_name:
        config = model_or_config if is_config else getattr(model_or_config, "config", None)
        model_name = getattr(config, "_name_or_path", "") or profile.model_name
    profile.model_name = model_name
    profile.seconds = time.perf_counter() - start
    return profile


def _folded(source: Any, is_config: bool, make: Callable[[Any], nn.Module], dtype: str,
            profile_of: Callable[[nn.Module], ModelProfile], workers: int = 1) -> ModelProfile | None:
    """The profile unfolded from a ``folding.TRACED``-layer model, checked against a traced
    model one layer deeper; None when the model is shallow or its layers do not repeat."""
    config = source if is_config else getattr(source, "config", None)
    layers = folding.layer_count(config)
    if layers is None or layers < folding.MIN_LAYERS:
        return None
    try:
        depths = (folding.TRACED, folding.TRACED + 1)
        models = [make(folding.truncated_config(source, depth)) if is_config
                  else folding.truncated_meta_model(source, dtype, depth, layers) for depth in depths]
        stacks = [folding.find_stack(meta, depth) for meta, depth in zip(models, depths)]
        per_layer = [_held_whole_bytes(meta.get_submodule(f"{stack.path}.1")) for meta, stack in zip(models, stacks)]
        if stacks[0] != stacks[1] or per_layer[0] != per_layer[1]:
            raise folding.NoFold("the layers hold different buffers")
        profiles = forked_map(profile_of, models, workers)
        stack = stacks[0]
        grown = folding.unfold_profile(profiles[0], stack, folding.TRACED, folding.TRACED + 1, per_layer[0])
        if not folding.same_profile(grown, profiles[1]):
            raise folding.NoFold("one more layer does not change the profile by one layer's share")
        profile = folding.unfold_profile(profiles[0], stack, folding.TRACED, layers, per_layer[0])
    except folding.NoFold as e:
        logger.debug("profiling every layer: %s", e)
        return None
    profile.extra["traced_layers"] = folding.TRACED
    return profile


def _held_whole_bytes(model: nn.Module) -> int:
    """Bytes every rank holds whole: buffers, parameters that are not chunked (8-bit
    quantised storage) and the quantisation state of packed 4-bit weights."""
    named = chunked_parameters(model)
    chunked = {id(p) for _, p in named}
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in chunked)
    return (whole + sum(b.numel() * b.element_size() for b in model.buffers())
            + sum(quant_state_bytes(p) for _, p in named))


def _profile_meta(meta: nn.Module, example_batch: dict[str, torch.Tensor] | tuple[int, int], dtype: str,
                  attention_target: str, checkpointing: bool | None) -> ModelProfile:
    """Trace one step of a meta model, with and (or) without checkpointing."""
    fetch_units = detect_fetch_units(meta)
    vocab = getattr(getattr(meta, "config", None), "vocab_size", None)
    batch = make_batch(example_batch, vocab, device="meta")
    bsz, seq = batch_shape(batch)
    named = chunked_parameters(meta)
    # elements as chunks of the compute dtype hold them (a packed 4-bit weight: its bytes)
    params = [ParamInfo(n, chunk_numel(p, DTYPE_BYTES[dtype]), tuple(p.shape), frozen=not p.requires_grad,
                        packed_weights=packed_weights(p))
              for n, p in named]
    borrowed = find_borrowed_reads(meta, batch, fetch_units)
    plain = ckpt = None
    if checkpointing is not True:
        plain = trace_step(meta, batch, fetch_units, attention_target, borrowed)
    can_ckpt = _supports_checkpointing(meta)
    if checkpointing is not False and can_ckpt:
        enable_checkpointing(meta)
        try:
            ckpt = trace_step(meta, batch, fetch_units, attention_target, borrowed)
        finally:
            disable_checkpointing(meta)
    if plain is None:
        plain = ckpt
    if plain is None:
        raise ValueError(f"{type(meta).__name__} does not support activation checkpointing")
    return ModelProfile(
        params=params,
        tied=tied_parameters(meta),
        buffer_bytes=_held_whole_bytes(meta),
        fetch_units=fetch_units,
        plain=plain,
        checkpointed=ckpt,
        batch_size=bsz,
        seq_len=seq,
        dtype=dtype,
        attention_target=attention_target,
        model_name=type(meta).__name__,
        borrowed=borrowed,
        extra=_block_extra(meta),
    )


def _block_extra(meta: nn.Module) -> dict[str, Any]:
    """Where the decoder blocks are (``profile.blocks`` cuts the traces there) and the
    head's shape (vocabulary, width), which the long-context planner prices per token."""
    found = decoder_blocks(meta)
    config = getattr(meta, "config", None)
    extra: dict[str, Any] = {}
    if found is not None:
        extra["block_path"] = found[0]
    for key, attr in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size")):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            extra[key] = value
    return extra


def measure_real_step(
    model: nn.Module,
    example_batch: dict[str, torch.Tensor] | tuple[int, int],
    checkpointing: bool = False,
) -> StepMemory:
    """Run one real step of ``model`` where it lives and measure it with the same tracker.

    This is the reference the meta profile is checked against. The model's checkpointing
    setting is restored afterwards; gradients are dropped as in ``run_step``.
    """
    device = next(model.parameters()).device
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    batch = make_batch(example_batch, vocab, device=device)
    was_training = model.training
    model.train()
    if checkpointing:
        enable_checkpointing(model)
    try:
        return run_step(model, batch, attention_target=None)
    finally:
        if checkpointing:
            disable_checkpointing(model)
        model.train(was_training)


__all__ = [
    "ModelProfile",
    "ParamInfo",
    "PassProfile",
    "enable_checkpointing",
    "measure_real_step",
    "module_parameters",
    "profile_model",
    "trace_step",
]
