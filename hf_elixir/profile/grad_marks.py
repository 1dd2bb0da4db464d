"""Learning when a module's backward starts and ends, without handing the model new views.

The runtime (``runtime/hooks.py``) fetches a module's chunks again just before its backward
and unpins them once it is over; the profiler (``profile/trace.py``) records the same two
moments to compute how many rCache blocks a model needs. Both must see exactly the same
moments, so both use these two helpers.

- ``on_output_grad``: a gradient hook on each grad-requiring output. It fires when the
  output's gradient is ready, i.e. before the module's own backward. No new tensor is
  returned, so the caller may modify the output in place (``h *= scale``): a hook registered
  before an in-place change still fires with the gradient of the value the module returned.
- ``alias_inputs``: the module receives ``x.view_as(x)`` instead of each grad-requiring
  input ``x``, and a hook on the alias fires once the gradient with respect to it is
  complete, i.e. after the module's backward. An alias per call (not a hook on ``x``
  itself) matters when one tensor feeds several modules (q, k and v projections): each
  module's backward ends on its own, not when the last of them is done. Autograd allows
  in-place changes to an ordinary view (unlike the output of a custom Function); a module
  that does change its input in place just ends its backward late (the alias's original
  node no longer runs and the end-of-backward cleanup unpins instead).

Imports nothing of hf_elixir, so both layers may use it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd.graph import register_multi_grad_hook


def grad_tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Append the grad-requiring tensors in ``obj`` (tensors, lists, tuples, dicts) to ``out``."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            grad_tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            grad_tensors(item, out)
    return out


def _replace(obj: Any, mapping: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return mapping.get(id(obj), obj)
    if isinstance(obj, tuple):
        items = [_replace(item, mapping) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [_replace(item, mapping) for item in obj]
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: _replace(v, mapping) for k, v in obj.items()}
        for k in list(obj.keys()):  # ModelOutput and friends: update in place
            obj[k] = _replace(obj[k], mapping)
        return obj
    return obj


def on_output_grad(output: Any, callback: Callable[[], None]) -> int:
    """Call ``callback`` whenever the gradient of one of ``output``'s grad-requiring tensors
    is ready (the caller makes repeated calls harmless). Returns how many tensors it hooked.

    An output that is a view (``nn.Linear`` on a 3-D input returns one) and is then modified
    in place is rebased by autograd onto its base: its own view node leaves the graph and a
    hook on it never fires. So the node that made the base is hooked as well."""
    hook = lambda *grads: callback()  # noqa: E731 - returns None: gradients are unchanged
    tensors = grad_tensors(output, [])
    for t in tensors:
        t.register_hook(hook)
        if t._is_view():
            base_fn = t._base.grad_fn
            if base_fn is not None:
                base_fn.register_prehook(hook)
    return len(tensors)


def alias_inputs(inputs: Any, callback: Callable[[], None]) -> Any:
    """``inputs`` with each grad-requiring tensor replaced by an alias; ``callback`` runs once
    the gradients of every alias that takes part in a backward have been computed."""
    tensors = grad_tensors(inputs, [])
    if not tensors:
        return inputs
    mapping = {id(t): t.view_as(t) for t in tensors}
    aliases = list(mapping.values())
    if len(aliases) == 1:
        aliases[0].register_hook(lambda grad: callback())
    else:
        register_multi_grad_hook(aliases, lambda grads: callback(), mode="all")
    return _replace(inputs, mapping)
