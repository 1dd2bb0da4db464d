"""One optimizer update over lists of views (of flat shards): PyTorch's own functional
update for the optimizer's row of the table (``hf_elixir/optimizers.py``), found by the
row's ``kernel`` in ``KERNELS`` (``ElixirOptimizer`` decides what the lists hold).

Adam(W) runs the fused kernel where the device has one, whatever the user's optimizer's
``fused``/``foreach`` flags say: one pass over a flat stretch is what makes the update fast,
and its bits are exactly ``AdamW(fused=True)``'s. PyTorch's default for-loop kernel on a
CPU may round the weight-decay term one ulp apart from the fused one (seen on an AVX-512
CPU), so a bit-for-bit reference uses ``fused=True``."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.optim import Optimizer
from torch.optim.adagrad import adagrad as functional_adagrad
from torch.optim.adam import adam as functional_adam
from torch.optim.adamw import adamw as functional_adamw
from torch.optim.sgd import sgd as functional_sgd

from hf_elixir.optimizers import OptimizerSpec, spec_of_class, supported_message


def spec_of(optimizer: Optimizer) -> OptimizerSpec:
    """The table's row for the update ``optimizer`` asks for; a clear error for any other."""
    found = spec_of_class(type(optimizer).__mro__, optimizer.defaults)
    if found is None:
        got = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        raise TypeError(f"ElixirOptimizer: {supported_message(got)}. "
                        "Create one of the supported optimizers over model.parameters()")
    return found


def algorithm_of(optimizer: Optimizer) -> str:
    """The table's name (``optimizers.OPTIMIZERS``) of the update ``optimizer`` asks for."""
    return spec_of(optimizer).name


def _fused_ok(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


def _moments(spec: OptimizerSpec, group: dict, device: torch.device, b: dict[str, list],
             started: set[int]) -> None:
    """Adam and AdamW: two moments, a step count per run."""
    fused = _fused_ok(device)
    beta1, beta2 = group["betas"]
    # functional adamw rather than adam(decoupled_weight_decay=True): the same kernel,
    # under a name every torch release since 2.0 has
    update = functional_adamw if spec.decoupled_weight_decay else functional_adam
    update(
        b["params"], b["grads"], b["exp_avg"], b["exp_avg_sq"], [], b["steps"],
        foreach=None if fused else True, fused=fused,
        amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group.get("maximize", False),
    )


def _momentum(spec: OptimizerSpec, group: dict, device: torch.device, b: dict[str, list],
              started: set[int]) -> None:
    """SGD, with or without momentum. Its momentum buffer starts from the first gradient,
    not from zeros: ``started`` holds the slots whose buffer has a value (and gains those
    this update starts)."""
    momentum = group.get("momentum", 0.0)
    bufs: list[Optional[torch.Tensor]] = []
    if momentum:
        for slot_idx, buf in zip(b["slots"], b["momentum_buffer"]):
            # SGD starts the buffer at the first gradient; zero state would shrink it
            bufs.append(buf if slot_idx in started else None)
    else:
        bufs = [None] * len(b["params"])
    functional_sgd(
        b["params"], b["grads"], bufs, foreach=False,
        weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
        dampening=group.get("dampening", 0.0), nesterov=group.get("nesterov", False),
        maximize=group.get("maximize", False),
    )
    if momentum:
        for slot_idx, new, flat_view in zip(b["slots"], bufs, b["momentum_buffer"]):
            if slot_idx not in started:
                flat_view.copy_(new)
                started.add(slot_idx)
    for step in b["steps"]:
        step += 1


def _squares(spec: OptimizerSpec, group: dict, device: torch.device, b: dict[str, list],
             started: set[int]) -> None:
    """Adagrad: the running sum of squared gradients, a step count per run (its rate decay)."""
    functional_adagrad(
        b["params"], b["grads"], b["sum"], b["steps"], foreach=False,
        lr=group["lr"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"], eps=group["eps"],
        maximize=group.get("maximize", False),
    )


#: each table row's ``kernel``: (row, group, device, batch of views, started slots)
KERNELS: dict[str, Callable[[OptimizerSpec, dict, torch.device, dict[str, list], set[int]], None]] = {
    "moments": _moments, "momentum": _momentum, "squares": _squares,
}


def apply_update(spec: OptimizerSpec, group: dict, device: torch.device, b: dict[str, list],
                 momentum_started: set[int]) -> None:
    """Update ``b["params"]`` from ``b["grads"]`` and the state lists by ``group``'s
    hyperparameters, with ``spec``'s kernel. ``momentum_started``: the slots whose
    from-the-first-gradient state has a value (``StateTensor.from_first_grad``)."""
    KERNELS[spec.kernel](spec, group, device, b, momentum_started)
