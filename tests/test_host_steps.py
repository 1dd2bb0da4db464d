"""The planner's price of the host's share of a GPU step (planner/host_steps.py): offloaded
chunks' updates run behind the next forward, which waits only where it reaches a chunk
before that chunk's update and upload have ended."""

from __future__ import annotations

import math
import random

import pytest

import hf_elixir as hfe
from hf_elixir.hardware import HardwareProfile
from hf_elixir.planner.cost import Access
from hf_elixir.planner.host_steps import HostSide, forward_reach, host_sides, pre_share
from hf_elixir.profile.configs import known_config


def test_the_forward_reaches_each_chunk_after_the_compute_before_its_first_read() -> None:
    seq = [Access("forward", "embed", (0,), 1.0), Access("forward", "block0", (1,), 2.0),
           Access("forward", "block0.again", (1,), 0.5), Access("forward", "block1", (2, 3), 4.0),
           Access("backward", "block1", (2, 3), 8.0), Access("forward", "head", (0,), 1.0)]
    # chunk 4 is never read by the forward: it waits for nothing before the forward's end
    assert forward_reach(seq, 5) == [0.0, 1.0, 3.5, 3.5, 8.5]


def _by_hand(rs_done, backward_end, reach, elems, W, cb, hw, ranks, chunks, k) -> HostSide:
    """One count ``k`` event by event: the tail's gradients down in backward order; when
    backward and every download ended, every chunk's gradient taken in and normed, then
    the updates in forward order, each followed by its upload; the next forward may start
    no later than any chunk's end less its reach."""
    if k == 0:
        return HostSide(-math.inf)
    tail = list(chunks)[len(chunks) - k:]
    link = 0.0
    for j in reversed(tail):
        link = max(link, rs_done[j]) + elems[j] / W * cb / hw.d2h_bandwidth
    t = max(backward_end, link)
    seconds = {j: elems[j] / W / (hw.cpu_adam_throughput / ranks) for j in tail}
    for j in tail:  # the gradients in and the norm, on the main thread
        t += pre_share(cb) * seconds[j]
    ready = -math.inf
    for j in tail:
        t += (1 - pre_share(cb)) * seconds[j]
        done = t + elems[j] / W * cb / hw.h2d_bandwidth
        ready = max(ready, done - reach[j])
    return HostSide(ready)


@pytest.mark.parametrize("seed", range(8))
def test_every_count_at_once_equals_each_count_by_hand(seed: int) -> None:
    rng = random.Random(seed)
    hw = HardwareProfile.preset("rtx4090")
    n = rng.randint(1, 12)
    elems = [rng.randint(1, 50) * 2**20 for _ in range(n)]
    # a long backward hides the downloads; after a short one the last ends past it
    backward_end = rng.choice([1.0, 0.005])
    rs_done = [backward_end * (1 - (j + 1) / (n + 1)) for j in range(n)]  # the tail reduced first
    reach = sorted(rng.uniform(0.0, 0.5) for _ in range(n))
    chunks = sorted(rng.sample(range(n), rng.randint(1, n)))  # the trainable ones
    W, cb, ranks = rng.choice([1, 2, 4]), rng.choice([2, 4]), rng.choice([1, 2])
    got = host_sides(rs_done, backward_end, reach, elems, W, cb, hw, ranks, chunks)
    assert len(got) == len(chunks) + 1
    for k, side in enumerate(got):
        want = _by_hand(rs_done, backward_end, reach, elems, W, cb, hw, ranks, chunks, k)
        assert side.ready == pytest.approx(want.ready, rel=1e-12, abs=1e-15), k


def test_the_host_time_before_the_first_update_follows_the_bytes_moved() -> None:
    # bf16: the download read (2) and the fp32 gradient written (4), the norm's read (4),
    # against the update's 28 and its bf16 copy (2); fp32: no copy, a 4-byte download
    assert pre_share(2) == pytest.approx(10 / 40) and pre_share(4) == pytest.approx(12 / 40)


def test_the_forward_waits_only_where_it_outruns_the_host() -> None:
    side = HostSide(ready=3.0)
    assert side.exposed(2.0) == 1.0 and side.exposed(3.5) == 0.0
    assert HostSide(-math.inf).exposed(0.0) == 0.0


def test_a_plan_that_offloads_hides_host_updates_behind_the_next_forward() -> None:
    """Llama-2 7B on one 24 GiB card offloads nearly every chunk's optimizer: the forward of
    the leading chunks hides part of the host's updates, never more than that forward takes."""
    p = hfe.plan(known_config("llama-2-7b"), (8, 1024), hardware="rtx4090", world_size=1, memory_budget="24GiB", dtype="bf16")
    t = p.predictions["time"]
    assert sum(c.optim_placement == "cpu" for c in p.chunks) > len(p.chunks) // 2
    device_end = t["forward_backward"] + t["device_optimizer"]
    assert t["step"] == pytest.approx(device_end + t["exposed_cpu"])
    # the serial price (updates after the device's, nothing behind the forward) is longer,
    # by at most the forward: about a third of forward and backward, a half with recompute
    serial = max(device_end, t["forward_backward"] + t["cpu_optimizer"])
    assert t["step"] < serial
    assert serial - t["step"] <= 0.5 * t["forward_backward"]
