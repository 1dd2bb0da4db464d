"""Parameters read outside their modules' forward: real values or a clear error, never a
silently empty tensor (runtime/released.py, runtime/hooks.py ``read_released``).

- Inside the model's forward (a fused LM-head loss reading ``get_output_embeddings().weight``
  as TRL's SFTTrainer does) the chunk is gathered on the spot and the result equals plain
  PyTorch, with the rCache too small to keep the head's chunk resident.
- In user code outside any forward, a read raises, naming the parameter; inside
  ``gathered_parameters()`` it gets the real values, and in training its gradient reaches
  the optimizer (the weights end where plain PyTorch's end).
- A dispatch-level watch over whole training steps, evaluation and generation finds no
  operator that received the released stand-in; with the stand-in made readable again (the
  old behaviour) the same watch catches it, so the watch can fail.
"""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from equivalence import assert_matches
from harness import run_distributed
from loops import elixir_steps, plain_steps
from tiny_models import make_batch, make_model

W = 2
BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-2
REG = 0.05  # weight of the regulariser computed outside the forward


# ---------------------------------------------------------------------- models
def _backbone(model):
    return model.transformer if hasattr(model, "transformer") else model.model


def make_fused_head_forward(original):
    def forward(self, input_ids=None, labels=None, fused_head=False, **kwargs):
        """What TRL's fused LM-head loss does when the trainer asks for it (and only then, so
        the plan's traced step, which does not ask, never sees the read): run the backbone,
        then read the head's weight directly; the head module itself never runs."""
        if not fused_head:
            return original(input_ids=input_ids, labels=labels, **kwargs)
        return fused_head_loss(self, input_ids, labels)

    return forward


def fused_head_loss(self, input_ids, labels):
    hidden = _backbone(self)(input_ids=input_ids).last_hidden_state
    weight = self.get_output_embeddings().weight
    logits = F.linear(hidden[:, :-1], weight)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    return {"loss": loss}


def build(arch: str, fused: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = make_model(arch)
    if fused:
        model.forward = types.MethodType(make_fused_head_forward(model.forward), model)
    return model


def regularised_parameter(model) -> tuple[str, torch.nn.Parameter]:
    name = "model.layers.0.mlp.up_proj.weight" if hasattr(model, "model") else "transformer.h.0.mlp.c_fc.weight"
    return name, model.get_parameter(name)


# ---------------------------------------------------------------------- plain reference
def loss_with(fused: bool, regularise: bool, weight: torch.nn.Parameter | None, gathered=contextlib.nullcontext):
    """The micro-batch loss: the head fused into it or not, and the regulariser on ``weight``
    computed outside the forward (read inside ``gathered(weight)``) or not."""
    ask = {"fused_head": True} if fused else {}

    def loss_fn(model, ids):
        loss = model(input_ids=ids, labels=ids, **ask)["loss"]
        if regularise:  # every rank adds the same term; averaged over ranks it counts once
            with gathered(weight):
                loss = loss + REG * weight.pow(2).mean()
        return loss

    return loss_fn


def reference(arch: str, fused: bool, regularise: bool) -> dict:
    model = build(arch, fused)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
    _, weight = regularised_parameter(model)
    losses = plain_steps(model, opt, [make_batch(BATCH, SEQ)] * STEPS, loss_fn=loss_with(fused, regularise, weight))
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# ---------------------------------------------------------------------- hf_elixir ranks
def _wrap(model, world_size: int):
    """An rCache at the model's minimum: chunks are released and gathered again all the
    time, and the head's chunk is not resident when it is read."""
    import hf_elixir as hfe

    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=2048)
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=2048, rcache_blocks=plan.min_rcache_blocks)
    assert plan.rcache_blocks < plan.n_chunks
    return hfe.ElixirModule(model, plan)


def elixir(rank: int, world_size: int, arch: str, fused: bool, regularise: bool) -> dict:
    import hf_elixir as hfe
    from hf_elixir.runtime.released import ReleasedParameterError

    model = build(arch, fused)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
    emodel = _wrap(model, world_size)
    eopt = hfe.ElixirOptimizer(emodel, opt)
    name, weight = regularised_parameter(model)
    ids = make_batch(BATCH, SEQ)
    per = BATCH // world_size
    rows = ids[rank * per : (rank + 1) * per]
    out: dict = {}

    # outside any forward: metadata answers, a read raises naming the parameter
    out["shape_while_released"] = tuple(weight.shape)
    try:
        weight.sum()
    except ReleasedParameterError as exc:
        out["error"] = str(exc)
    with torch.no_grad(), emodel.gathered_parameters(weight):
        out["gathered_values"] = weight.detach().clone()
    out["reference_values"] = emodel.state_dict()[name]

    caught = warnings.catch_warnings(record=True)
    out["warnings"] = caught.__enter__()
    warnings.simplefilter("always")
    out["losses"] = elixir_steps(emodel, eopt, [rows] * STEPS,
                                 loss_fn=loss_with(fused, regularise, weight, emodel.gathered_parameters))
    caught.__exit__(None, None, None)
    out["warnings"] = [str(w.message) for w in out["warnings"] if issubclass(w.category, RuntimeWarning)]
    out["state"] = emodel.state_dict()
    return out


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # tied head, untied head
def test_a_fused_head_loss_reading_the_weight_inside_forward_matches_plain(arch) -> None:
    ref = reference(arch, fused=True, regularise=False)
    got = run_distributed(elixir, W, arch, True, False)
    assert_matches(ref, got[0], label=f"{arch} fused head")


def test_a_read_outside_the_forward_raises_or_is_gathered_and_trains() -> None:
    ref = reference("llama", fused=False, regularise=True)
    got = run_distributed(elixir, W, "llama", False, True)
    for rank in got:
        assert rank["shape_while_released"] == (64, 32)
        assert "model.layers.0.mlp.up_proj.weight" in rank["error"]
        assert "gathered_parameters" in rank["error"]
        assert torch.equal(rank["gathered_values"], rank["reference_values"])
        # at the rCache minimum the held chunk takes a block beyond the plan: said once
        over = [w for w in rank["warnings"] if "held for reads outside their modules" in w]
        assert len(over) == 1, rank["warnings"]
    # the regulariser's gradient reached the optimizer: the weights end where plain ends
    assert_matches(ref, got[0], label="regularised outside the forward")


# ---------------------------------------------------------------------- the watch
class StandInWatch(TorchDispatchMode):
    """Records every operator that receives a tensor backed by the runtime's stand-in
    storage, and counts operators that receive any parameter storage (so a watch that saw
    nothing cannot pass)."""

    def __init__(self, placeholder: torch.Tensor, param_storages: set[int]) -> None:
        super().__init__()
        self.placeholder = placeholder.untyped_storage()._cdata
        self.param_storages = param_storages
        self.stand_in_reads: list[str] = []
        self.param_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.as_strided.default:  # the runtime making a stand-in: no read
            return func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    sid = t.untyped_storage()._cdata
                    if sid == self.placeholder:
                        self.stand_in_reads.append(str(func))
                    elif sid in self.param_storages:
                        self.param_reads += 1
        return func(*args, **kwargs)


def watched_steps(rank: int, world_size: int, model_type: str, fused: bool, old_stand_in: bool) -> dict:
    import hf_elixir as hfe

    if old_stand_in:  # what hf_elixir did before: a released parameter is merely empty
        import hf_elixir.runtime.chunk as chunk_module

        def mark_released(param, placeholder):
            param.data = placeholder[:0]  # empty, on the stand-in's storage

        chunk_module.mark_released = mark_released
        import hf_elixir.runtime.module as module_module

        module_module.mark_released = mark_released
    if model_type in ("gpt2", "llama"):
        model = build(model_type, fused)
        ids = make_batch(4, SEQ)
    else:
        from arch_configs import build_tiny, make_ids

        torch.manual_seed(0)
        model = build_tiny(model_type)
        if fused:
            model.forward = types.MethodType(make_fused_head_forward(model.forward), model)
        ids = make_ids(4, SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    emodel = _wrap(model, world_size)
    eopt = hfe.ElixirOptimizer(emodel, opt)
    storages = {c.full.untyped_storage()._cdata for c in emodel.chunks}
    storages |= {c.shard.untyped_storage()._cdata for c in emodel.chunks}
    watch = StandInWatch(emodel._placeholder, storages)
    error = None
    try:
        with watch:
            ask = {"fused_head": True} if fused else {}
            # a training step, then one more after the optimizer released all
            elixir_steps(emodel, eopt, [ids] * 2, clip=1.0, loss_fn=loss_with(fused, False, None))
            emodel.eval()
            with torch.no_grad():
                emodel(input_ids=ids, labels=ids, **ask)
                if not fused:
                    emodel.generate(input_ids=ids[:, :4], max_new_tokens=3, do_sample=False)
    except Exception as exc:  # the old stand-in may crash after the watch saw it
        error = f"{type(exc).__name__}: {exc}"
    return {"stand_in_reads": watch.stand_in_reads, "param_reads": watch.param_reads, "error": error}


@pytest.mark.parametrize("model_type,fused", [("qwen2", False), ("qwen2", True), ("gpt2", True)])
def test_no_operator_ever_reads_the_released_stand_in(model_type, fused) -> None:
    for rank in run_distributed(watched_steps, W, model_type, fused, False):
        assert rank["error"] is None, rank["error"]
        assert rank["param_reads"] > 100
        assert rank["stand_in_reads"] == [], rank["stand_in_reads"][:5]


def test_the_watch_catches_the_old_empty_stand_in() -> None:
    ranks = run_distributed(watched_steps, W, "llama", True, True)
    assert any(rank["stand_in_reads"] for rank in ranks)
