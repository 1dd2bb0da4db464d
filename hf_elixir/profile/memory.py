"""Activation and temporary memory over one training step, measured by following storages.

A ``TorchDispatchMode`` sees every tensor an operator returns. ``LiveStorageTracker``
remembers each new untyped storage (by a weak reference, so it never keeps one alive) and
its ``nbytes``; when the storage dies the weak-reference callback subtracts it. The running
total is the bytes of activations and temporaries alive at that instant; its maximum is the
peak. Storages that existed before the step (parameters, buffers, the batch) are excluded,
and views share their base's storage so they are never counted twice.

The same tracker works on the meta device (the planner: nothing is allocated, ``nbytes``
is still exact) and on a real device (the accuracy test compares the two).

Two details keep meta faithful to a real run:

- ``scaled_dot_product_attention`` is a composite operator that picks a fused kernel by
  device. On meta it would decompose into the math path and materialise the full attention
  matrix, which a real CPU or GPU run never does. ``SDPAKernelMode`` asks PyTorch which
  kernel the target device would pick and calls that kernel directly (its meta
  implementation gives the real output and log-sum-exp shapes).
- Data-dependent reads (``tensor.item()``, ``bool(tensor)``) are impossible on meta; the
  tracker answers them with neutral values (``True`` for booleans, ``0`` for numbers), which
  selects the common path in Transformers (no packed sequences, no padding).
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

try:  # the FLOP formulas PyTorch's own FlopCounterMode uses
    from torch.utils.flop_counter import flop_registry as _FLOP_REGISTRY
except Exception:  # pragma: no cover - very old torch
    _FLOP_REGISTRY = {}

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


def _storage_key(storage: torch.UntypedStorage) -> int:
    # ``_cdata`` is the address of the C++ StorageImpl: stable for the storage's lifetime and
    # shared by every Python handle and view of it (meta storages have no data pointer).
    return storage._cdata


class LiveStorageTracker(TorchDispatchMode):
    """Counts the bytes of storages created while active and still alive.

    Attributes:
        current: bytes alive now.
        peak: the largest ``current`` seen.
        flops: matmul/convolution FLOPs of the operators seen (PyTorch's flop formulas).
        marks: named snapshots of ``current`` and ``peak`` (see ``mark``).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), count_flops: bool = True):
        super().__init__()
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._excluded: set[int] = set()
        self._exclude_refs: list[torch.UntypedStorage] = []
        for t in exclude:
            self.exclude(t)
        self.current = 0
        self.peak = 0
        self.flops = 0
        self.count_flops = count_flops
        self.marks: dict[str, tuple[int, int]] = {}
        self.on_flops: Callable[[int], None] | None = None
        #: called for every operator with (FLOPs, bytes it reads or rewrites, bytes of each newly
        #: allocated output, matmul layout or "strided", bytes read against their layout): the
        #: per-event work the cost model prices (``EventWork``)
        self.on_op: Callable[..., None] | None = None

    def exclude(self, tensor: torch.Tensor) -> None:
        """Never count this tensor's storage (it existed before the step)."""
        st = tensor.untyped_storage()
        self._exclude_refs.append(st)  # keep the key from being reused while we run
        self._excluded.add(_storage_key(st))

    def reset_peak(self) -> None:
        self.peak = self.current

    def mark(self, name: str) -> None:
        self.marks[name] = (self.current, self.peak)

    # ------------------------------------------------------------------ internals
    def _track(self, t: torch.Tensor) -> int:
        """Start following ``t``'s storage if it is new; returns its bytes if so, else 0."""
        try:
            st = t.untyped_storage()
        except Exception:  # tensors without storage (sparse, nested): ignore
            return 0
        key = _storage_key(st)
        if key in self._live or key in self._excluded:
            return 0
        nbytes = st.nbytes()
        live = self._live

        def _died(_ref, key=key, nbytes=nbytes, tracker=self):
            if live.pop(key, None) is not None:
                tracker.current -= nbytes

        live[key] = (weakref.ref(st, _died), nbytes)
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        return nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _LOCAL_SCALAR and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            x = args[0]
            if x.dtype == torch.bool:
                return True
            return 0.0 if (x.is_floating_point() or x.is_complex()) else 0
        out = META_KERNELS.run(func, args, kwargs)
        fresh = [nb for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and (nb := self._track(t))]
        n = 0
        if self.count_flops and func._overloadpacket in _CPU_ATTENTION:
            n = _cpu_attention_flops(func, args, kwargs)
            self.flops += n
            if self.on_flops is not None:
                self.on_flops(n)
        elif self.count_flops and _FLOP_REGISTRY:
            fn = _FLOP_REGISTRY.get(func._overloadpacket)
            if fn is not None:
                try:
                    n = int(fn(*args, **kwargs, out_val=out))
                except Exception:
                    n = 0
                if func._overloadpacket in _GPU_ATTENTION and _is_causal(func, args, kwargs):
                    n //= 2  # PyTorch's formula counts every block; a causal mask skips about half
                self.flops += n
                if self.on_flops is not None:
                    self.on_flops(n)
        if self.on_op is not None:
            if func._overloadpacket in TRANSCENDENTAL:  # priced per element, not per byte
                elems = sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
                self.on_op(n, 0, fresh, "", 0, elems)
                return out
            read = 0 if n or _moves_no_data(func) else _bytes_read(args, kwargs, out)
            if read and _mixed_layouts(args):
                self.on_op(n, 0, fresh, "strided", read)
            else:
                self.on_op(n, read, fresh, matmul_layout(func, args) if n else "")
        return out


def _call(func, args, kwargs):
    try:
        return func(*args, **kwargs)
    except RuntimeError:
        return _meta_retry_in_bf16(func, args, kwargs)


class MetaKernelCache:
    """What meta kernels returned, by operator and input layouts, so each is run once.

    On the meta device an operator's outputs depend on nothing but its inputs' shapes,
    strides and dtypes and its other arguments, and many meta kernels are Python functions:
    tracing a transformer runs the same few hundred operators on the same layouts once per
    layer and pass. Only operators whose schema says they return new tensors (no output
    aliases an input, no input is written) are remembered; their outputs are rebuilt as
    fresh meta tensors of the same shapes, strides and dtypes, which is all a meta kernel
    makes. Anything else (views, in-place operators, tensor subclasses, arguments that are
    not plain values) runs the kernel every time."""

    LIMIT = 200_000

    def __init__(self) -> None:
        self._outputs: dict[tuple, Any] = {}
        self._fresh_only: dict[Any, bool] = {}
        self.enabled = True  # tests compare profiles made with and without it

    def clear(self) -> None:
        """Forget every remembered output (a benchmark timing a cold start)."""
        self._outputs.clear()

    def run(self, func, args, kwargs):
        key = self._key(func, args, kwargs) if self.enabled else None
        if key is None:
            return _call(func, args, kwargs)
        spec = self._outputs.get(key)
        if spec is not None:
            leaves, tree = spec
            return tree_unflatten([torch.empty_strided(leaf[1], leaf[2], dtype=leaf[3], device="meta")
                                   if leaf[0] == "T" else leaf[1] for leaf in leaves], tree)
        out = _call(func, args, kwargs)
        spec = self._spec(out, args, kwargs)
        if spec is not None:
            if len(self._outputs) >= self.LIMIT:
                self._outputs.clear()
            self._outputs[key] = spec
        return out

    def _fresh(self, func) -> bool:
        known = self._fresh_only.get(func)
        if known is None:
            schema = getattr(func, "_schema", None)
            known = schema is not None and not any(r.alias_info is not None for r in schema.returns) and not any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
            self._fresh_only[func] = known
        return known

    def _key(self, func, args, kwargs) -> tuple | None:
        if not self._fresh(func):
            return None
        try:
            parts = [func, torch.get_default_dtype()]
            _append_key(parts, args)
            _append_key(parts, tuple(sorted(kwargs.items())) if kwargs else ())
        except _Uncacheable:
            return None
        key = tuple(parts)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    @staticmethod
    def _spec(out, args, kwargs) -> tuple | None:
        """How to rebuild ``out``: None unless every tensor in it is a plain meta tensor
        with a storage of its own (not an input's, not another output's)."""
        leaves, tree = tree_flatten(out)
        taken = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        spec = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if (type(leaf) is not torch.Tensor or not leaf.is_meta or leaf.storage_offset() != 0
                        or leaf.is_conj() or leaf.is_neg() or leaf.layout != torch.strided):
                    return None
                storage = leaf.untyped_storage()
                rebuilt = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device="meta")
                if storage._cdata in taken or rebuilt.untyped_storage().nbytes() != storage.nbytes():
                    return None
                taken.add(storage._cdata)
                spec.append(("T", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype))
            elif leaf is None or isinstance(leaf, (bool, int, float, str, torch.dtype)):
                spec.append(("V", leaf))
            else:
                return None
        return spec, tree


class _Uncacheable(Exception):
    pass


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _append_key(parts: list, value) -> None:
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, nn.Parameter) or not value.is_meta or value.layout != torch.strided:
            raise _Uncacheable
        parts.append(("T", tuple(value.shape), value.stride(), value.dtype, value.storage_offset(),
                      value.is_conj(), value.is_neg()))
    elif isinstance(value, (list, tuple)):
        parts.append(len(value))
        for v in value:
            _append_key(parts, v)
    elif isinstance(value, _PLAIN):
        parts.append((type(value), value))
    else:
        raise _Uncacheable


#: shared by every trace in the process: a plan's passes and depths, and later plans, reuse it
META_KERNELS = MetaKernelCache()


_aten = torch.ops.aten
#: element-wise operators bound by arithmetic (exp, tanh, ...), not by memory: one core runs
#: tanh over 256k elements in 1 ms, 20x what its bytes would take
TRANSCENDENTAL = {_aten.tanh, _aten.tanh_backward, _aten.exp, _aten.log, _aten.sigmoid,
                  _aten.sigmoid_backward, _aten.silu, _aten.silu_backward, _aten.gelu,
                  _aten.gelu_backward, _aten.erf, _aten.pow, _aten._softmax,
                  _aten._softmax_backward_data, _aten._log_softmax, _aten._log_softmax_backward_data,
                  _aten.rsqrt, _aten.sin, _aten.cos}
#: the CPU's fused attention kernels, which PyTorch's FLOP registry does not know
_CPU_ATTENTION = {_aten._scaled_dot_product_flash_attention_for_cpu,
                  _aten._scaled_dot_product_flash_attention_for_cpu_backward}


#: the GPU's fused attention kernels, whose FLOPs PyTorch's registry counts as if no mask
#: skipped a block (``_is_causal`` halves them for a causal one, as for the CPU kernel)
_GPU_ATTENTION = {getattr(_aten, name) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")
    if hasattr(_aten, name)}


def _is_causal(func, args, kwargs) -> bool:
    """The ``is_causal`` argument of an attention kernel call, found by its schema."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "is_causal":
            return bool(args[i]) if i < len(args) else bool(arg.default_value)
    return False


def _cpu_attention_flops(func, args, kwargs) -> int:
    """FLOPs of the CPU flash-attention kernel: 4·b·h·s_q·s_k·d forward (two matmuls),
    2.5 times that backward; a causal mask skips about half the blocks."""
    backward = func._overloadpacket is _aten._scaled_dot_product_flash_attention_for_cpu_backward
    q, k = (args[1], args[2]) if backward else (args[0], args[1])
    b, h, sq, d = q.shape
    causal = kwargs.get("is_causal", args[7] if backward and len(args) > 7 else
                        args[4] if not backward and len(args) > 4 else False)
    flops = 4 * b * h * sq * k.shape[-2] * d * (2.5 if backward else 1.0)
    return int(flops * (0.5 if causal else 1.0))


def _mixed_layouts(args) -> bool:
    """Whether an element-wise operator combines same-shaped tensors laid out differently
    (one row-major, one transposed): it then walks one of them against its layout, several
    times slower than a contiguous pass. (A tied embedding's two gradients do not: both come
    out row-major in the models measured.)"""
    orders = set()
    shape = None
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.numel() > 1:
            if shape is not None and t.shape != shape:
                return False
            shape = t.shape
            orders.add(t.stride(-1) == 1)
    return len(orders) > 1


_MATMUL_OPERANDS = {torch.ops.aten.mm: (0, 1), torch.ops.aten.bmm: (0, 1),
                    torch.ops.aten.addmm: (1, 2), torch.ops.aten.baddbmm: (1, 2)}


def matmul_layout(func, args) -> str:
    """"NN", "NT", "TN" or "TT": whether each operand of a matmul is a transposed view.

    The same product runs at different rates by layout (nn.Linear's ``x @ W.T`` and GPT-2's
    Conv1D ``x @ W`` differ, and so do their backward products), so the cost model keeps
    matmuls by layout as well as by size. "" for other FLOP-counted operators.
    """
    where = _MATMUL_OPERANDS.get(func._overloadpacket)
    if where is None or len(args) <= max(where):
        return ""

    def transposed(t) -> bool:
        return (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.stride(-2) == 1
                and t.stride(-1) != 1 and t.size(-1) > 1)

    return "".join("T" if transposed(args[i]) else "N" for i in where)


def _moves_no_data(func) -> bool:
    """Views, aliases and fresh allocations: an operator call, but no bytes moved."""
    return bool(getattr(func, "is_view", False)) or func._overloadpacket in _NO_DATA_OPS


_NO_DATA_OPS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
                torch.ops.aten.detach, torch.ops.aten.lift_fresh}


def _bytes_read(args, kwargs, out) -> int:
    """Bytes an operator that is not a matmul reads, or writes in place.

    Each distinct input tensor counts once, and an in-place op's output is its input; what
    a view sees is what it reads, not its base's whole storage. Newly allocated outputs are
    counted apart (``fresh``): on a CPU their first touch costs page faults, a far lower
    rate than reading or rewriting memory already mapped.
    """
    seen: set[int] = set()
    total = 0
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _meta_retry_in_bf16(func, args, kwargs):
    """Some meta kernels check CUDA-only dtype rules (``_grouped_mm`` wants bf16, the CPU
    kernel takes fp32 too). Re-run such an op on bf16 meta inputs for its output shapes and
    give the outputs the dtype of the original inputs; anything else re-raises."""
    flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if "grouped_mm" not in str(func) or not flat or not all(a.is_meta for a in flat):
        return func(*args, **kwargs)
    dtype = next(a.dtype for a in flat if a.is_floating_point())
    from torch.utils._pytree import tree_map

    cast = tree_map(lambda a: a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a,
                    (args, kwargs))
    out = func(*cast[0], **cast[1])
    return tree_map(lambda o: o.to(dtype) if isinstance(o, torch.Tensor) and o.is_floating_point() else o, out)


# ---------------------------------------------------------------------- attention kernels
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3


def _sdp_choice(target: str, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """The fused kernel ``target`` ("cpu" or "cuda") would pick for tensors like these."""
    if target == "cuda" and not torch.cuda.is_available():
        # Planning for a GPU we do not have: flash for half precision without a mask,
        # memory-efficient attention otherwise; both keep O(S) extra memory.
        if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            return _FLASH
        return _EFFICIENT
    device = "cuda" if target == "cuda" else "cpu"

    def proxy(t):
        if t is None:
            return None
        # One row of real memory expanded to the full shape: right dtype, shape and
        # last-dimension stride for the kernel checks, without allocating the tensor.
        return torch.empty(t.shape[-1], dtype=t.dtype, device=device).expand(t.shape)

    try:
        return int(torch._fused_sdp_choice(
            proxy(q), proxy(k), proxy(v), attn_mask=proxy(attn_mask), dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        ))
    except Exception:
        return _MATH


class SDPAKernelMode:
    """Route meta ``scaled_dot_product_attention`` to the fused kernel the target would use.

    A context manager that swaps ``torch.nn.functional.scaled_dot_product_attention`` for a
    wrapper while it is active (a ``TorchFunctionMode`` would not do: the recomputation of
    activation checkpointing runs inside ``backward``, where a function mode is suspended).
    Real tensors go to the original function untouched.
    """

    def __init__(self, target: str = "cpu"):
        self.target = target
        self._original = None

    def __enter__(self) -> "SDPAKernelMode":
        F = torch.nn.functional
        self._original = original = F.scaled_dot_product_attention

        def scaled_dot_product_attention(*args, **kwargs):
            q = args[0] if args else kwargs.get("query")
            if isinstance(q, torch.Tensor) and q.is_meta:
                out = self._fused(*args, **kwargs)
                if out is not None:
                    return out
            return original(*args, **kwargs)

        F.scaled_dot_product_attention = scaled_dot_product_attention
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.functional.scaled_dot_product_attention = self._original

    def _fused(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
               scale=None, enable_gqa=False):
        choice = _sdp_choice(self.target, query, key, value, attn_mask, dropout_p, is_causal,
                             scale, enable_gqa)
        if choice not in (_FLASH, _EFFICIENT, _CUDNN):
            return None
        aten = torch.ops.aten
        try:
            # the flash kernels take grouped-query key/value heads as they are
            if self.target == "cpu" and choice == _FLASH:
                return aten._scaled_dot_product_flash_attention_for_cpu(
                    query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
            if choice == _FLASH and attn_mask is None:
                return aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            if enable_gqa and key.shape[-3] != query.shape[-3]:
                rep = query.shape[-3] // key.shape[-3]
                key = key.repeat_interleave(rep, dim=-3)
                value = value.repeat_interleave(rep, dim=-3)
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:
                bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device)
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]
        except Exception:
            return None


# ---------------------------------------------------------------------- one step
@dataclass
class StepMemory:
    """Live activation/temporary bytes over one forward+backward (parameters excluded).

    Attributes:
        peak: the largest bytes alive at any instant of the step.
        forward_peak: the largest bytes alive during forward.
        saved: bytes alive when forward returns (what backward needs, plus the loss/logits).
        flops: matmul FLOPs of the whole step (recomputation included).
        forward_flops: matmul FLOPs of the forward alone.
    """

    peak: int
    forward_peak: int
    saved: int
    flops: int
    forward_flops: int
    extra: dict[str, Any] = field(default_factory=dict)


def loss_of(output: Any) -> torch.Tensor:
    """The scalar to call backward on: the model's loss, else a sum of its first output."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None:
        first = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
        loss = first.float().sum()
    return loss


def run_step(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    attention_target: str | None = None,
    on_forward_done: Callable[[], None] | None = None,
    on_backward_start: Callable[[], None] | None = None,
    tracker: LiveStorageTracker | None = None,
) -> StepMemory:
    """Run one forward and backward under a live-storage tracker and report its memory.

    Gradients are dropped as soon as they are accumulated, because the runtime moves each
    gradient into its chunk's buffer (a separate, planned category), so they are not
    activations. ``attention_target`` ("cpu"/"cuda") routes meta attention to the fused kernel
    that device would run; it is ignored for real tensors.
    """
    params = [p for p in model.parameters()]
    handles = [
        p.register_post_accumulate_grad_hook(_drop_grad) for p in params if p.requires_grad
    ]
    exclude = params + list(model.buffers()) + [t for t in batch.values() if isinstance(t, torch.Tensor)]
    tracker = tracker or LiveStorageTracker()
    for t in exclude:
        tracker.exclude(t)
    try:
        with ExitStack() as stack:
            if attention_target is not None:
                stack.enter_context(SDPAKernelMode(attention_target))
            stack.enter_context(tracker)
            output = model(**batch)
            loss = loss_of(output)
            del output  # a training loop keeps the loss through backward, not the logits
            forward_peak, saved, forward_flops = tracker.peak, tracker.current, tracker.flops
            if on_forward_done is not None:
                on_forward_done()
            if on_backward_start is not None:
                on_backward_start()
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
    return StepMemory(peak=tracker.peak, forward_peak=forward_peak, saved=saved,
                      flops=tracker.flops, forward_flops=forward_flops)


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None
