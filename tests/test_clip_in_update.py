"""Gradient clipping folded into the host update (``Chunk.grad_factor``).

``clip_grad_norm_`` leaves the factor pending on every host chunk whose update runs the
one-pass loop, which multiplies each gradient by it as it reads it: the pass that scaled
those shards on the main thread, before any update could start, is gone. Checked against
the same run with the factor multiplied in by ``clip_grad_norm_`` as before (the runtime's
own clipping with nothing deferred), on real ranks (one, and two joined by gloo), the host
updates behind the next forward as by default, in bf16 and in fp16 (whose inf check in
``step`` leaves the factor pending too):

- the weights, every step's total norm and the gradients are equal bit for bit;
- the factor was pending after every clip (the fold ran), and never in the reference;
- a backward with no ``zero_grad`` after the step adds to the clipped gradient, as in
  PyTorch (the pending factor is multiplied in before anything is added);
- a reader after the step (``grad_shards.values``, a second clip) sees clipped values.
"""

from __future__ import annotations

import pytest
import torch

import hf_elixir as hfe
from harness import run_distributed
from tiny_models import offloaded_gpt2

MAX_NORM = 0.05  # far below these gradients' norm: every step clips


def _train(rank: int, world_size: int, fold: bool, dtype: str) -> dict:
    from hf_elixir.runtime import grad_shards, optim
    from hf_elixir.runtime.chunk import Chunk

    if not fold:  # the reference: clip_grad_norm_ multiplies every shard, nothing deferred
        clip = grad_shards.clip
        optim.grad_shards.clip = lambda *args: clip(*args[:5])
    multiplied = [0]  # pending factors multiplied in by a pass of their own
    settle = Chunk.settle_grad

    def counted(self, keep_factor: bool = False) -> None:
        multiplied[0] += self.grad_factor is not None and not keep_factor and not self.grad_zeroed
        settle(self, keep_factor)

    Chunk.settle_grad = counted
    torch.set_num_threads(1)
    model, emodel = offloaded_gpt2(world_size, dtype)
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    assert opt.one_pass is not None and opt.host_chunks
    g = torch.Generator().manual_seed(rank)
    out: dict = {"totals": [], "pending": [], "grads": [], "multiplied_in_steps": 0}
    for step in range(4):
        ids = torch.randint(0, 256, (2, 32), generator=g)
        opt.backward(emodel(input_ids=ids, labels=ids).loss)
        out["totals"].append(float(opt.clip_grad_norm_(MAX_NORM)))
        out["pending"].append([c.grad_factor is not None for c in emodel.chunks if c.index in opt.host_chunks])
        before = multiplied[0]
        opt.step()  # fp16's inf check included: none of it multiplies a pending factor in
        emodel.host_updates.wait_all()
        out["multiplied_in_steps"] += multiplied[0] - before
        if step in (0, 2):  # after step 1 the next backward adds to the clipped gradients
            opt.zero_grad()
    emodel.host_updates.wait_all()  # the last step's gradients, read after it
    grads = grad_shards.by_device(emodel.chunks, emodel.disk)
    out["grads"] = [g.clone() for group in grads.values() for g in grad_shards.values(group, emodel.disk)]
    # fp16: a clip unscales first, and the scaler's state after a step has it unscale again
    out["scale"] = float(opt.scaler.scale) if opt.scaler is not None else 1.0
    out["second_clip"] = float(opt.clip_grad_norm_(1e9))
    emodel.host_updates.wait_all()
    out["masters"] = [c.master.clone() for c in emodel.chunks if not c.frozen]
    emodel.close()
    return out


@pytest.mark.parametrize("world_size,dtype", [(1, "bfloat16"), (2, "bfloat16"), (1, "float16")])
def test_clipping_in_the_host_update_equals_clipping_first_bit_for_bit(world_size: int, dtype: str) -> None:
    folded = run_distributed(_train, world_size, True, dtype)
    reference = run_distributed(_train, world_size, False, dtype)
    for ours, theirs in zip(folded, reference):
        assert all(all(p) and p for p in ours["pending"]), ours["pending"]
        assert not any(any(p) for p in theirs["pending"])
        assert ours["multiplied_in_steps"] == 0
        assert ours["totals"] == theirs["totals"] and all(t > 10 * MAX_NORM for t in ours["totals"])
        assert len(ours["grads"]) == len(theirs["grads"]) > 0
        assert all(torch.equal(a, b) for a, b in zip(ours["grads"], theirs["grads"]))
        # read after the step: clipped to MAX_NORM (a little above: the 1e-6 in the factor)
        assert ours["second_clip"] == theirs["second_clip"] == pytest.approx(MAX_NORM / ours["scale"], rel=1e-3)
        assert all(torch.equal(a, b) for a, b in zip(ours["masters"], theirs["masters"]))
