"""One optimizer update over lists of views (of flat shards): PyTorch's own functional
AdamW, Adam or SGD (``ElixirOptimizer`` decides what the lists hold).

Adam(W) runs the fused kernel where the device has one, whatever the user's optimizer's
``fused``/``foreach`` flags say: one pass over a flat stretch is what makes the update fast,
and its bits are exactly ``AdamW(fused=True)``'s. PyTorch's default for-loop kernel on a
CPU may round the weight-decay term one ulp apart from the fused one (seen on an AVX-512
CPU), so a bit-for-bit reference uses ``fused=True``."""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.optim.adam import adam as functional_adam
from torch.optim.adamw import adamw as functional_adamw
from torch.optim.sgd import sgd as functional_sgd

SUPPORTED = (AdamW, Adam, SGD)


def algorithm_of(optimizer: Optimizer) -> str:
    """The update ``optimizer`` asks for, by its name in ``vocab.OPTIMIZERS`` ("adamw",
    "adam" or "sgd"); a clear error for any other."""
    if isinstance(optimizer, AdamW):
        return "adamw"
    if isinstance(optimizer, Adam):
        return "adamw" if optimizer.defaults.get("decoupled_weight_decay") else "adam"
    if isinstance(optimizer, SGD):
        return "sgd"
    names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED)
    raise TypeError(
        f"ElixirOptimizer supports {names}; got {type(optimizer).__module__}.{type(optimizer).__name__}. "
        "Create one of the supported optimizers over model.parameters()"
    )


def _fused_ok(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


def apply_update(algorithm: str, group: dict, device: torch.device, b: dict[str, list],
                 momentum_started: set[int]) -> None:
    """Update ``b["params"]`` from ``b["grads"]`` and the state lists by ``group``'s
    hyperparameters. SGD's momentum buffers start from the first gradient, not from zeros:
    ``momentum_started`` holds the slots whose buffer has a value (and gains those this
    update starts)."""
    fused = _fused_ok(device)
    if algorithm in ("adamw", "adam"):
        beta1, beta2 = group["betas"]
        # functional adamw rather than adam(decoupled_weight_decay=True): the same kernel,
        # under a name every torch release since 2.0 has
        update = functional_adamw if algorithm == "adamw" else functional_adam
        update(
            b["params"], b["grads"], b["exp_avg"], b["exp_avg_sq"], [], b["steps"],
            foreach=None if fused else True, fused=fused,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group.get("maximize", False),
        )
        return
    momentum = group.get("momentum", 0.0)
    bufs: list[Optional[torch.Tensor]] = []
    if momentum:
        for slot_idx, buf in zip(b["slots"], b["momentum_buffer"]):
            # SGD starts the buffer at the first gradient; zero state would shrink it
            bufs.append(buf if slot_idx in momentum_started else None)
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
            if slot_idx not in momentum_started:
                flat_view.copy_(new)
                momentum_started.add(slot_idx)
    for step in b["steps"]:
        step += 1
