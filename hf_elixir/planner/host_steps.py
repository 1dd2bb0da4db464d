"""The host's share of a GPU step: offloaded chunks' gradients down, their updates on the
host behind the next forward, the updated shards up.

The runtime (``runtime/host_update.py``) starts the host updates when ``step()`` has the
global gradient norm, so after backward and after every offloaded gradient came down (global
clipping and fp16's inf check read them all). It updates the chunks one at a time in the
order the next forward first needs them, on a thread of its own, while ``step()`` returns
after the device's updates and the next forward starts. A chunk's first use in that forward
waits for its own update and upload only. Offloaded chunks are the tail of the packing
order, the last the forward reaches, so the forward of the leading chunks hides the updates
of the trailing ones, and the step is longer only by what the forward waits.

That is what is priced here, for every count ``k`` of offloaded chunks at once: when the
forward would first read each chunk (``forward_reach``: the compute before it, stalls left
out, so the wait is if anything overestimated), and when each offloaded chunk's update and
upload end. The host's calibrated rate (``cpu_adam_throughput``, ``measure/host_rate.py``)
covers all it does for an element; part of that, the downloaded gradient's copy into the
fp32 shard and the clipping norm's read, the main thread does for every chunk before the
first update starts (``pre_share``, by the bytes each part moves). Prefix sums make all
counts one pass: each larger ``k`` puts one more chunk at the head of the update order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from hf_elixir.hardware import HardwareProfile
from hf_elixir.planner.cost import Access


@dataclass(frozen=True)
class HostSide:
    """The host side of a step with ``k`` chunks' optimizer offloaded: ``ready``, in seconds
    from the step's start, the latest start of the next forward that no offloaded chunk
    would make wait (the most any chunk's update and upload end after the forward's first
    read of it); ``-inf`` with nothing offloaded."""

    ready: float

    def exposed(self, device_end: float) -> float:
        """What the next forward waits for the host when it starts at ``device_end``."""
        return max(0.0, self.ready - device_end)


def pre_share(compute_bytes: int) -> float:
    """The share of the host's time for an offloaded element spent before any update: the
    download read and the fp32 gradient written (``compute_bytes + 4``) and the norm's read
    (4), against the update's 28 bytes (fp32 master, gradient, two moments read; three
    written) and a compute-dtype copy written where it is narrower than fp32."""
    before = compute_bytes + 4 + 4
    update = 28 + (compute_bytes if compute_bytes < 4 else 0)
    return before / (before + update)


def forward_reach(seq: Sequence[Access], n_chunks: int) -> list[float]:
    """Per chunk: the compute seconds of the forward before its first forward access (the
    whole forward's for a chunk the forward never reads: backward reads it later still)."""
    reach = [math.nan] * n_chunks
    t = 0.0
    for access in seq:
        if access.phase != "forward":
            continue
        for c in access.chunks:
            if math.isnan(reach[c]):
                reach[c] = t
        t += access.seconds
    return [t if math.isnan(r) else r for r in reach]


def host_sides(rs_done: Sequence[float], backward_end: float, reach: Sequence[float], elems: Sequence[int],
               world_size: int, compute_bytes: int, hw: HardwareProfile, ranks_per_node: int,
               chunks: Sequence[int] | None = None) -> list[HostSide]:
    """The host side with the last ``k`` chunks of ``chunks`` offloaded (the trainable ones in
    packing order; default all), for k = 0..len(chunks).

    Gradients come down in backward's order (the tail first: reduced first, their copies
    overlap the rest of backward). When backward and the last download have ended, the host
    takes every chunk's gradient in and reads it for the norm, then updates the chunks one
    after another in forward order, all at the host's rate (shared by the node's ranks);
    each update is followed by the upload of its compute-dtype shard."""
    order = list(range(len(rs_done)) if chunks is None else chunks)
    rate = hw.cpu_adam_throughput / max(1, ranks_per_node)
    pre = pre_share(compute_bytes)
    shard = [elems[j] / world_size for j in order]
    host = [s / rate for s in shard]
    upload = [s * compute_bytes / hw.h2d_bandwidth for s in shard]
    # before[i]: the host seconds of order[:i]. With order[a:] offloaded, the updates start
    # pre * (before[n] - before[a]) after backward and the last download, and chunk i's
    # update and upload end (1 - pre) * (before[i + 1] - before[a]) + upload[i] after that
    before = [0.0]
    for t in host:
        before.append(before[-1] + t)
    n = len(order)
    sides = [HostSide(-math.inf)]
    link = 0.0
    latest = -math.inf
    for i in reversed(range(n)):  # k = n - i chunks offloaded: order[i:]
        j = order[i]
        link = max(link, rs_done[j]) + shard[i] * compute_bytes / hw.d2h_bandwidth
        latest = max(latest, (1 - pre) * before[i + 1] + upload[i] - reach[j])
        start = max(backward_end, link) + pre * (before[n] - before[i]) - (1 - pre) * before[i]
        sides.append(HostSide(start + latest))
    return sides
