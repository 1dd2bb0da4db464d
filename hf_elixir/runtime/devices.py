"""Where a rank computes, and getting its inputs and host buffers there.

``resolve_device`` picks (and makes current) the CUDA device this rank owns;
``move_to_device`` moves a batch's tensors, however nested, to it; ``pinned_pool`` makes the
page-locked host memory the copies across PCIe read and write.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch


def resolve_device(device: Optional[torch.device | str] = None) -> torch.device:
    """The compute device, made current for CUDA.

    Default: ``cuda:LOCAL_RANK`` (the launcher's local rank; the current CUDA device when it
    is unset), else the CPU. ``"cpu"`` forces the CPU on a GPU machine. A CUDA device
    becomes the current device, so the collectives, the allocator and the copy stream all
    use the device this rank owns instead of cuda:0.
    """
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return device
        index = device.index
    elif torch.cuda.is_available():
        index = None
    else:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if index is None:
        local = os.environ.get("LOCAL_RANK")
        index = int(local) if local is not None else torch.cuda.current_device()
        if index >= count and count == 1:
            index = 0  # one visible device per process (CUDA_VISIBLE_DEVICES set per rank)
    if not 0 <= index < count:
        raise RuntimeError(
            f"this rank should compute on cuda:{index} (LOCAL_RANK={os.environ.get('LOCAL_RANK')}) "
            f"but {count} CUDA devices are visible; launch at most {count} processes per node, "
            "or pass device= explicitly"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def move_to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (nested in tuples, lists and mappings) on ``device``.
    Host-to-device copies are asynchronous (they are ordered on the compute stream)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        items = [move_to_device(item, device) for item in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, Mapping):
        moved = {k: move_to_device(v, device) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        try:
            return type(obj)(moved)  # BatchEncoding and other dict-likes
        except Exception:
            return moved
    return obj


def pinned_pool(dtype: torch.dtype, sizes: list[int]) -> list[torch.Tensor]:
    """Views of one pinned host allocation of exactly ``sum(sizes)`` elements."""
    pool = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
    views, start = [], 0
    for n in sizes:
        views.append(pool[start : start + n])
        start += n
    return views
