"""World size 1 with every chunk gathered in place (``HookManager.lean``): the per-module
tensor hooks that fetch a chunk again before its backward are not made, since nothing can
evict an in-place chunk. What they also did must still happen: the end of every backward is
seen (the time report's pass spans the backward; recovery's differentiation of a scaled loss
by the model's loss must not end it early), and training is plain PyTorch's. At world size 2
the hooks are made as before."""

from __future__ import annotations

import copy
import time
from unittest import mock

import pytest
import torch

import hf_elixir as hfe
from equivalence import assert_state_close
from harness import run_distributed
from loops import plain_steps
from tiny_models import make_batch, make_model

ACCUMULATE = 2
STEPS = 3


def _hooks_in_one_forward(emodel, ids: torch.Tensor) -> int:
    """How many tensor hooks one training forward registers."""
    count = 0
    register = torch.Tensor.register_hook

    def counting(tensor, hook):
        nonlocal count
        count += 1
        return register(tensor, hook)

    with mock.patch.object(torch.Tensor, "register_hook", counting):
        emodel(input_ids=ids, labels=ids)
    return count


@pytest.mark.parametrize("checkpointing", [False, True])
def test_in_place_chunks_train_like_pytorch_without_per_module_hooks(checkpointing) -> None:
    torch.manual_seed(0)
    model = make_model("llama")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    reference = copy.deepcopy(model)
    batches = [make_batch(4, 16, seed=s) for s in range(STEPS * ACCUMULATE)]

    plain_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    plain_steps(reference, plain_opt, batches, clip=1.0, accumulate=ACCUMULATE)

    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=1 << 14))
    assert emodel.hooks.lean and all(c.in_place for c in emodel.chunks)
    assert len(emodel.hooks.units) > 4
    assert _hooks_in_one_forward(emodel, batches[0]) <= 2  # one module's outputs, not every module's
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-3))
    opt.zero_grad()
    backward_walls = []
    for step in range(STEPS):
        walls = 0.0
        for ids in batches[step * ACCUMULATE:(step + 1) * ACCUMULATE]:
            loss = emodel(input_ids=ids, labels=ids).loss / ACCUMULATE  # recovery links this scaling
            start = time.perf_counter()
            opt.backward(loss)
            walls += time.perf_counter() - start
        backward_walls.append(walls)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    assert_state_close(reference.state_dict(), emodel.state_dict(), label="lean")
    steps = emodel.clock.steps()
    assert [s["micro_batches"] for s in steps] == [ACCUMULATE] * STEPS
    for step, walls in zip(steps, backward_walls):
        # each pass runs from its forward to its backward's end, so the passes hold the
        # backward calls whole (a pass ended early by the loss link held a forward only)
        assert step["forward_backward"] >= walls, (step["forward_backward"], walls)
    emodel.close()


def _lean_runtime(seed: int = 0):
    """A plain copy and an hf_elixir runtime of one tiny Llama at world size 1, every chunk in
    place, with AdamW on both sides."""
    torch.manual_seed(seed)
    model = make_model("llama", seed=seed)
    model.train()
    reference = copy.deepcopy(model)
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=1 << 14))
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, reference, emodel, opt, torch.optim.AdamW(reference.parameters(), lr=1e-3)


def test_in_place_gradients_are_the_shard_and_steps_release_nothing() -> None:
    """A step costs what plain PyTorch's does: autograd adds each gradient into the chunk's
    gradient shard itself (the parameter's ``.grad`` is its place there), and an optimizer
    step leaves every in-place chunk gathered, so no parameter is released and gathered
    again (two class swaps each) per step."""
    from hf_elixir.runtime import chunk as chunk_module

    model, reference, emodel, opt, plain_opt = _lean_runtime()
    batches = [make_batch(4, 16, seed=s) for s in range(STEPS)]
    emodel(input_ids=batches[0], labels=batches[0])  # the first forward gathers every chunk
    marks = mock.Mock()
    with mock.patch.object(chunk_module, "mark_released", marks.released), \
            mock.patch.object(chunk_module, "mark_gathered", marks.gathered):
        for ids in batches:
            opt.backward(emodel(input_ids=ids, labels=ids).loss)
            for chunk in emodel.chunks:
                for slot in chunk.slots:
                    grad = slot.param.grad
                    assert grad is not None and grad.untyped_storage().data_ptr() == \
                        chunk.grad_shard.untyped_storage().data_ptr(), slot.name
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    assert marks.released.call_count == 0 and marks.gathered.call_count == 0
    # read outside any forward after a step: the in-place weights are the updated ones
    plain_steps(reference, plain_opt, batches, clip=1.0)
    for (name, theirs), ours in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=name)
    emodel.close()


@pytest.mark.parametrize("between", ["model_zero_grad", "create_graph"])
def test_gradients_in_the_shard_keep_pytorch_semantics(between: str) -> None:
    """Where autograd hands a new gradient tensor instead of adding into the view, PyTorch's
    meaning is kept: after the wrapped model's own ``zero_grad()`` (which sets ``.grad`` to
    None, that is zero) the next micro-batch's gradient replaces what was accumulated; with
    ``create_graph=True`` autograd sums out of place, and the sum is the gradient."""
    model, reference, emodel, opt, plain_opt = _lean_runtime(seed=3)
    batches = [make_batch(4, 16, seed=s) for s in range(4)]
    create_graph = between == "create_graph"
    for side, run, step_opt in ((reference, reference, plain_opt), (model, emodel, opt)):
        for step in range(2):
            for micro, ids in enumerate(batches[2 * step:2 * step + 2]):
                loss = run(input_ids=ids, labels=ids).loss / 2
                loss.backward(create_graph=create_graph)
                if micro == 0 and not create_graph:
                    side.zero_grad()  # the HF model's own: the first micro-batch is dropped
            step_opt.step()
            step_opt.zero_grad()
    for (name, theirs), ours in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-6, msg=name)
    emodel.close()


def _two_ranks(rank: int, world_size: int) -> tuple[bool, int, int]:
    torch.manual_seed(0)
    model = make_model("llama")
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=1 << 14))
    count = _hooks_in_one_forward(emodel, make_batch(2, 16))
    lean, units = emodel.hooks.lean, len(emodel.hooks.units)
    emodel.close()
    return lean, count, units


def test_sharded_chunks_keep_the_per_module_hooks() -> None:
    for lean, count, units in run_distributed(_two_ranks, 2):
        assert not lean
        assert count >= units  # every fetch unit's inputs or outputs are hooked


def _unit_hooks(emodel) -> int:
    """Forward hooks the runtime has on the model's fetch units (modules with chunks)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in emodel.hooks.units)


def _grad_hooks(emodel) -> int:
    """Parameters carrying a post-accumulate-grad hook (read past a released parameter's
    interception of everything it is asked)."""
    with torch._C.DisableTorchFunctionSubclass():
        return sum(bool(getattr(s.param, "_post_accumulate_grad_hooks", None)) for s in emodel.slots)


def test_a_resident_runtime_has_no_module_hooks_and_a_load_is_gathered_again() -> None:
    """Everything resident (one rank, in place, no step releases a chunk): no per-module hook
    is installed at all, and training is still plain PyTorch's. A load releases every chunk;
    the next forward gathers them, and so does a submodule called on its own (no unit hook
    would have)."""
    model, reference, emodel, opt, plain_opt = _lean_runtime(seed=5)
    batches = [make_batch(4, 16, seed=s) for s in range(2 * STEPS)]
    assert emodel.hooks.resident and _unit_hooks(emodel) == 0
    # nor a hook per parameter: each .grad is its place in the shard, and the end of each
    # backward notes which of them autograd added into (their version counters)
    assert _grad_hooks(emodel) == 0 and emodel.reducer.collecting
    for ids in batches[:STEPS]:
        opt.backward(emodel(input_ids=ids, labels=ids).loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    assert emodel.hooks.resident and _unit_hooks(emodel) == 0
    plain_steps(reference, plain_opt, batches[:STEPS], clip=1.0)

    emodel.load_state_dict(emodel.state_dict())  # what a checkpoint load does to the chunks
    assert not any(c.state.name == "GATHERED" for c in emodel.chunks)
    probe = batches[0][:, :4]
    torch.testing.assert_close(model.model.embed_tokens(probe), reference.model.embed_tokens(probe),
                               rtol=0, atol=1e-6)
    for ids in batches[STEPS:]:
        opt.backward(emodel(input_ids=ids, labels=ids).loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    plain_steps(reference, plain_opt, batches[STEPS:], clip=1.0)
    for (name, theirs), ours in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-6, msg=name)
    assert len(emodel.clock.steps()) == 2 * STEPS  # every backward's end was seen
    emodel.close()


def test_module_hooks_come_back_when_a_step_releases_chunks_or_faults_are_injected(monkeypatch) -> None:
    """Chunks updated on the host thread behind the next forward are released by each step
    (their reads wait for the update), and an injected fault fires from the module hooks: in
    both cases the hooks are installed, from the next forward on."""
    torch.manual_seed(0)
    model = make_model("llama")
    model.train()
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=1 << 14, offload_fraction=0.5))
    assert emodel.hooks.resident and _unit_hooks(emodel) == 0
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-3), overlap_host=True)
    assert opt.background_chunks and not emodel.hooks.resident
    assert _unit_hooks(emodel) == 2 * len(emodel.hooks.units)
    assert _grad_hooks(emodel) == len(emodel.slots) and not emodel.reducer.collecting
    ids = make_batch(4, 16)
    opt.backward(emodel(input_ids=ids, labels=ids).loss)
    opt.step()
    emodel.close()

    monkeypatch.setenv("ELIXIR_INJECT_OOM", "5:forward")
    model = make_model("llama")
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=1 << 14))
    assert emodel.hooks.lean and not emodel.hooks.resident
    assert _unit_hooks(emodel) == 2 * len(emodel.hooks.units)
    emodel.close()
