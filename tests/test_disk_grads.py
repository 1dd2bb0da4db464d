"""Gradient shards of disk-tier chunks live in their files (runtime/disk_grads.py).

- The planes behave as an in-memory fp32 shard would under any sequence of what a run does
  to a gradient (reductions added in, ``zero_grad``, fp16 unscaling and clipping recorded,
  norms, the update's read), checked against plain tensors doing the same.
- Training with them is the host tier's training bit for bit: gradient accumulation,
  clipping, fp16's loss scaling, steps without ``zero_grad`` between them, SGD with
  momentum; and no disk chunk keeps a gradient shard in memory.
"""

from __future__ import annotations

import random

import pytest
import torch

import hf_elixir as hfe
from hf_elixir.runtime.disk_tier import GRAD, DiskChunk, DiskPlan
from test_disk_tier import _assert_same, _assert_same_opt, _batches, _model, _plan


def test_gradient_planes_behave_as_in_memory_shards(tmp_path) -> None:
    numels = [1000, 3000, 1024, 7]
    chunks, offset = [], 0
    for cid, n in enumerate(numels):
        chunks.append(DiskChunk(cid, n, offset, ("state0", "state1", GRAD)))
        offset += chunks[-1].region_bytes
    tier = DiskPlan(tmp_path, chunks).open(0)
    tier.set_state_names(("exp_avg", "exp_avg_sq"))
    grads = tier.grads
    reference = {cid: torch.zeros(n) for cid, n in enumerate(numels)}
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        cid = rng.randrange(len(numels))
        op = rng.choice(["add", "add", "add", "forget", "scale", "scale_tensor", "norm", "update"])
        if op == "add":  # a reduction, sometimes two in flight, or two of one chunk
            other = rng.choice([(cid + 1) % len(numels), cid])
            first, second = torch.randn(numels[cid], generator=gen), torch.randn(numels[other], generator=gen)
            a = grads.open(cid)
            b = grads.open(other)
            a.add_(first)
            b.add_(second)
            grads.close(other)
            grads.close(cid)
            reference[cid].add_(first)
            reference[other].add_(second)
        elif op == "forget":
            grads.forget(cid)
            reference[cid].zero_()
        elif op in ("scale", "scale_tensor"):
            factor = rng.uniform(0.1, 2.0)
            factor = torch.tensor(factor) if op == "scale_tensor" else factor
            grads.scale(factor)
            for t in reference.values():
                t.mul_(factor)
        else:
            grads.settle()
            if op == "norm":
                assert torch.equal(grads.read_scaled(cid), reference[cid]), (op, cid)
                continue
            for _ in range(rng.choice([1, 2])):  # a second read finds the first's buffer
                assert torch.equal(tier.acquire(cid)[GRAD], reference[cid]), (op, cid)
                tier.release(cid, write=rng.random() < 0.5)
    tier.close()
    assert list(tmp_path.iterdir()) == []


def _train(disk: bool, nvme: str, dtype: str, optimizer: str, accumulate: int, zero_grad: bool) -> tuple:
    model = _model(64, 12)
    plan = _plan(model, 1, 64 * 64, disk)
    plan.compute_dtype = dtype
    emodel = hfe.ElixirModule(model, plan, nvme_path=nvme)
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
             else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    opt = hfe.ElixirOptimizer(emodel, inner)
    batches = _batches(0, 4 * accumulate)
    for step in range(4):
        for ids in batches[step * accumulate : (step + 1) * accumulate]:
            opt.backward(emodel(input_ids=ids, labels=ids)["loss"] / accumulate)
        opt.clip_grad_norm_(0.5)
        opt.step()
        if zero_grad or step % 2:
            opt.zero_grad()
    emodel.host_updates.wait_all()
    on_disk = [c for c in emodel.chunks if c.disk]
    facts = {"disk_chunks": len(on_disk), "grads_in_memory": sum(c.grad_shard.device.type != "meta" for c in on_disk),
             "written": emodel.disk.counters.written_bytes if disk else 0,
             "grad_plane_bytes": sum(emodel.disk.chunks[c.index].plane_bytes for c in on_disk) if disk else 0}
    out = (emodel.state_dict(), opt.state_dict(), facts)
    emodel.close()
    return out


@pytest.mark.parametrize("dtype, optimizer, accumulate, zero_grad", [
    ("float32", "adamw", 2, True),       # accumulation: planes read back and added into
    ("float16", "adamw", 1, True),       # loss scaling: unscale and inf check on the planes
    ("bfloat16", "sgd", 2, False),       # gradients carried over steps without zero_grad
])
def test_training_with_gradients_on_disk_is_the_host_tiers(dtype, optimizer, accumulate, zero_grad, tmp_path) -> None:
    host = _train(False, str(tmp_path), dtype, optimizer, accumulate, zero_grad)
    disk = _train(True, str(tmp_path), dtype, optimizer, accumulate, zero_grad)
    _assert_same(host[0], disk[0])
    _assert_same_opt(host[1], disk[1])
    facts = disk[2]
    assert facts["disk_chunks"] >= 4 and facts["grads_in_memory"] == 0
    # every disk chunk's gradient went to its file at each micro-batch, besides its state
    assert facts["written"] >= 4 * accumulate * facts["grad_plane_bytes"]
    assert list(tmp_path.iterdir()) == []
