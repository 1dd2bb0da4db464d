"""The optimizer's update calls (runtime/batches.py): neighbours in a shard updated alike are
one view, one kernel call over a flat stretch, and training is still plain PyTorch's: with
parameter groups, with parameters that miss a step's gradient (their step counts part from
the others'), and after a load that sets the counts."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_elixir as hfe
from tiny_models import make_batch, make_model

LR = 1e-3


def _groups(model: torch.nn.Module, split: bool) -> list[dict]:
    """One group, or the Trainer's two (no weight decay on biases and norms)."""
    if not split:
        return [{"params": list(model.parameters()), "weight_decay": 0.1}]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _loss(model: torch.nn.Module, ids: torch.Tensor, step: int) -> torch.Tensor:
    """Every other step a loss on the final hidden states only: the LM head gets no gradient."""
    if step % 2:
        return model.model(input_ids=ids).last_hidden_state.pow(2).mean()
    return model(input_ids=ids, labels=ids).loss


def _train(model, opt, steps: int, backward, start: int = 0) -> None:
    for step in range(start, start + steps):
        ids = make_batch(4, 16, seed=step)
        backward(_loss(model, ids, step))
        opt.step()
        opt.zero_grad(set_to_none=True)


def _setup(split: bool):
    torch.manual_seed(0)
    model = make_model("llama")
    model.config.tie_word_embeddings = False
    model.train()
    reference = copy.deepcopy(model)
    plain = torch.optim.AdamW(_groups(reference, split), lr=LR, fused=True)
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=1 << 14))
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(_groups(model, split), lr=LR))
    return model, reference, plain, emodel, opt


def _assert_same(reference, model, plain, opt) -> None:
    """Bit for bit: the reference runs the kernel the runtime runs (``fused=True``); the
    default for-loop kernel may round weight decay an ulp apart, which Adam then amplifies
    where a gradient is near zero."""
    for (name, theirs), ours in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(ours.detach(), theirs.detach()), name
    ours = opt.state_dict()["state"]
    theirs = plain.state_dict()["state"]
    assert {i: float(s["step"]) for i, s in ours.items()} == {i: float(s["step"]) for i, s in theirs.items()}


@pytest.mark.parametrize("split", [False, True], ids=["one_group", "two_groups"])
def test_neighbours_updated_alike_are_one_call_and_train_like_pytorch(split: bool) -> None:
    model, reference, plain, emodel, opt = _setup(split)
    _train(reference, plain, 1, lambda loss: loss.backward())
    _train(model, opt, 1, opt.backward)
    batches = opt.batching.get(torch.ones(len(emodel.slots), dtype=torch.uint8))
    views = sum(len(b["params"]) for b in batches.values())
    trainable = [c for c in emodel.chunks if not c.frozen]
    if not split:
        assert views == len(trainable)  # one flat stretch per chunk shard
    else:
        # a run never crosses a group: as many views as changes of group along the shards
        changes = 0
        for chunk in trainable:
            groups = [opt.group_of_slot[s.index] for s, *_ in chunk.local_slices()]
            changes += 1 + sum(a != b for a, b in zip(groups, groups[1:]))
        assert views == changes < len(emodel.slots)
    # steps where the head has no gradient: it is skipped, its count falls behind, its run
    # splits from its neighbours', as PyTorch skips a parameter whose .grad is None
    _train(reference, plain, 5, lambda loss: loss.backward(), start=1)
    _train(model, opt, 5, opt.backward, start=1)
    _assert_same(reference, model, plain, opt)
    emodel.close()


def test_a_load_sets_each_count_and_training_goes_on_like_pytorch() -> None:
    """Counts that differ between neighbours (the head missed steps) survive a round trip of
    the optimizer's state, though a run's parameters shared one count tensor before it."""
    model, reference, plain, emodel, opt = _setup(split=False)
    _train(reference, plain, 4, lambda loss: loss.backward())
    _train(model, opt, 4, opt.backward)
    saved = copy.deepcopy(opt.state_dict())
    steps = {float(s["step"]) for s in saved["state"].values()}
    assert len(steps) == 2  # the head's count and everyone else's
    opt.load_state_dict(saved)
    _train(reference, plain, 3, lambda loss: loss.backward(), start=4)
    _train(model, opt, 3, opt.backward, start=4)
    _assert_same(reference, model, plain, opt)
    emodel.close()


@pytest.mark.parametrize("split", [False, True], ids=["one_group", "two_groups"])
def test_each_count_advances_once_for_each_step_its_parameter_had_a_gradient(split: bool) -> None:
    """The bookkeeping alone, over random patterns of which parameters had a gradient: each
    call's count tensor is advanced once (as the kernels do), no tensor is in two calls, and
    every parameter's count is the number of steps it had a gradient in."""
    model, _, _, emodel, opt = _setup(split)
    n = len(emodel.slots)
    expected = [0] * n
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        active = (torch.rand(n, generator=g) < 0.7).to(torch.uint8)
        batches = opt.batching.get(active)
        counts = [t for b in batches.values() for t in b["steps"]]
        assert len({id(t) for t in counts}) == len(counts)
        for t in counts:
            t += 1
        for i in range(n):
            expected[i] += int(active[i])
        assert [int(float(opt.steps[i])) for i in range(n)] == expected
        views = [v for b in batches.values() for v in b["params"]]
        assert sum(v.numel() for v in views) >= sum(emodel.slots[i].numel for i in range(n) if active[i])
    emodel.close()
