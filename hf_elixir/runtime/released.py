"""A released parameter is unreadable, not empty.

While its chunk is released, a parameter's data is a stand-in that holds no values (one
element of storage seen through zero strides). Code that reads
a parameter without calling the module that owns it (a trainer's fused loss reading
``get_output_embeddings().weight``, a regulariser, a metric) would compute silently wrong
results from it. So a released parameter also changes class, to a subclass of its own class
whose ``__torch_function__`` intercepts every operation on it:

- metadata (shape, dtype, device, ``requires_grad``, ``grad``, hashing, hooks) answers as
  the real parameter would: ``p.shape`` is the parameter's own shape, never ``(0,)``;
- any operation that reads its values asks the runtime (``reader``): inside the model's
  forward or backward, where every rank runs the same code, the runtime gathers the chunk
  and holds it until that pass's backward is over, so the read sees the real weight and its
  gradient reaches the chunk; anywhere else it raises ``ReleasedParameterError`` naming the
  parameter and what to do, because a gather is a collective and code outside the model may
  run on one rank only.

Gathering restores the original class, so a gathered parameter costs nothing extra: only
released parameters pay for the interception. The class swap is how PyTorch's own lazy
parameters become real ones (``UninitializedParameter.materialize``); the object, its id,
its hooks and its place in optimizers never change.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from hf_elixir.vocab import HfElixirError
from torch import nn
from torch.utils._pytree import tree_flatten

Tensor = torch.Tensor

def _passthrough() -> set:
    """Operations that only read metadata (or the gradient): they answer without the values.
    Built by name, so an attribute a torch version lacks is simply not listed."""
    properties = ("grad", "requires_grad", "dtype", "device", "layout", "is_leaf", "grad_fn",
                  "is_cuda", "is_meta", "is_cpu", "is_sparse", "is_quantized", "retains_grad",
                  "name", "_version", "_backward_hooks", "data")
    methods = ("requires_grad_", "is_floating_point", "is_complex", "element_size", "get_device",
               "register_hook", "register_post_accumulate_grad_hook", "__hash__")
    out = set()
    for name in properties:
        prop = getattr(Tensor, name, None)
        for accessor in ("__get__", "__set__", "__delete__"):
            if name == "data" and accessor == "__get__":
                continue  # ``p.data`` hands out the values: a read like any other
            fn = getattr(prop, accessor, None)
            if fn is not None:
                out.add(fn)
    out.update(getattr(Tensor, name) for name in methods if hasattr(Tensor, name))
    out.add(torch.is_complex)
    return out


_PASSTHROUGH = _passthrough()


def _shape_answers() -> dict[Callable, Callable[[torch.Size, tuple, dict], Any]]:
    def size(shape: torch.Size, args: tuple, kwargs: dict) -> Any:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return shape if dim is None else shape[dim]

    def numel(shape: torch.Size, args: tuple, kwargs: dict) -> int:
        return shape.numel()

    def full_like(shape: torch.Size, args: tuple, kwargs: dict) -> Tensor:
        # an optimizer's eager state (torch.optim.Adagrad fills its sums when it is built):
        # the value spread over the shape with zero strides, no memory and no gather;
        # ElixirOptimizer drops the inner optimizer's state and keeps its own, sharded
        value = args[1] if len(args) > 1 else kwargs["fill_value"]
        p = args[0]
        dtype = kwargs.get("dtype") or p.dtype
        return torch.full((), value, dtype=dtype, device=p.device).expand(shape)

    return {
        torch.full_like: full_like,
        Tensor.shape.__get__: lambda shape, a, k: shape,
        Tensor.size: size,
        Tensor.numel: numel,
        Tensor.nelement: numel,
        Tensor.dim: lambda shape, a, k: len(shape),
        Tensor.ndimension: lambda shape, a, k: len(shape),
        Tensor.ndim.__get__: lambda shape, a, k: len(shape),
        Tensor.__len__: lambda shape, a, k: shape[0],
    }


_SHAPES = _shape_answers()


class ReleasedParameterError(HfElixirError, RuntimeError):
    """A parameter whose chunk is released was read where the runtime cannot gather it."""


class _Released:
    """Mixed into a parameter's own class while its chunk is released (see module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PASSTHROUGH:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _SHAPES:
            return _SHAPES[func](args[0]._hf_elixir_shape, args, kwargs)
        if func is Tensor.__repr__:
            p = args[0]
            return f"Parameter(released by hf_elixir: {p._hf_elixir_name}, shape {tuple(p._hf_elixir_shape)})"
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, _Released):
                t._hf_elixir_reader(t)
        # every released parameter among the arguments is gathered now (or the reader raised)
        return func(*args, **kwargs)


_CLASSES: dict[type, type] = {}


def _released_class(cls: type) -> type:
    rel = _CLASSES.get(cls)
    if rel is None:
        rel = type(f"Released{cls.__name__}", (_Released, cls), {"__module__": __name__})
        _CLASSES[cls] = rel
    return rel


def mark_released(param: nn.Parameter, placeholder: torch.Tensor) -> None:
    """Give ``param`` the stand-in data and make it unreadable (idempotent).

    The stand-in is ``placeholder``'s single element viewed at the parameter's own shape with
    zero strides: it costs nothing, and metadata that bypasses ``__torch_function__`` (a
    custom autograd Function records its inputs' shapes in ``apply()``, before its forward
    reads them) still sees the real shape, so the gradient it returns is accepted."""
    if isinstance(param, _Released):
        return
    shape = param.shape
    param.data = placeholder.as_strided(shape, (0,) * len(shape))
    param.__class__ = _released_class(type(param))


def mark_gathered(param: nn.Parameter, view: torch.Tensor) -> None:
    """Give ``param`` its gathered data and its own class back."""
    if isinstance(param, _Released):
        param.__class__ = type(param).__mro__[2]  # (Released<cls>, _Released, cls, ...)
    param.data = view


def attach_reader(param: nn.Parameter, name: str, shape: torch.Size,
                  reader: Callable[[nn.Parameter], None]) -> None:
    """Tell ``param`` its name, its real shape and whom to ask when it is read released."""
    param._hf_elixir_name = name
    param._hf_elixir_shape = torch.Size(shape)
    param._hf_elixir_reader = reader


def detach_reader(param: nn.Parameter) -> None:
    for attr in ("_hf_elixir_name", "_hf_elixir_shape", "_hf_elixir_reader"):
        param.__dict__.pop(attr, None)


def is_released(param: torch.Tensor) -> bool:
    return isinstance(param, _Released)


def released_read_error(name: str, hint: Optional[str] = None) -> ReleasedParameterError:
    return ReleasedParameterError(
        f"hf_elixir: parameter {name!r} was read outside the model's forward and backward, "
        "while its chunk is released (only a shard of it is on this rank). Gathering it here "
        "would be a collective that code outside the model may run on one rank only. Read it "
        "inside `with model.gathered_parameters(<param>):` on every rank (a method of the "
        "ElixirModule that accelerator.prepare() or the Trainer returned), or for a copy of "
        "the weights use `accelerator.get_state_dict(model)` / that module's `state_dict()` "
        "(e.g. `save_pretrained(folder, state_dict=accelerator.get_state_dict(model))`)"
        + (f"; {hint}" if hint else "")
    )
