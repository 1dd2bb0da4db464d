"""Planning leaves the user's model as it found it (issue 60, finding 6).

Where the meta device cannot run a model, planning (``profile.needs``) runs one real forward
and backward of it on a synthetic batch. The model here reads a value of its input
(``.tolist()``), which no meta tensor has, so that fallback runs; it has a submodule in eval
while the top is in train (a BatchNorm, whose running statistics a step in train mode
would move), a buffer its forward counts into, gradients from an earlier backward, the
user's own activation checkpointing, and hooks that count their calls. After planning all
of that is as it was, the random state too, and the fallback said so once, naming the
meta error.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import hf_elixir as hfe
from hf_elixir.profile import needs
from hf_elixir.profile.user_hooks import is_user_hook


class _BatchNormed(nn.Module):
    """A BatchNorm over the hidden features of ``(batch, seq, hidden)`` activations."""

    def __init__(self, hidden: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(hidden)

    fail = False  # raise after the BatchNorm ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(x.transpose(1, 2)).transpose(1, 2)
        if self.fail:
            raise RuntimeError("this step fails after the statistics moved")
        return out


class DataDependentLlama(tf.LlamaForCausalLM):
    """A tiny Llama whose forward reads its token ids on the host (``.tolist()``, as byte
    patching does): a meta copy cannot run it (``meta_safe`` False). Its final norm is a
    BatchNorm, and a buffer counts the tokens it has seen."""

    meta_safe = False

    def __init__(self, config: tf.LlamaConfig):
        super().__init__(config)
        self.model.norm = _BatchNormed(config.hidden_size)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))

    def forward(self, input_ids=None, labels=None, **kwargs):
        if not self.meta_safe:
            self.tokens_seen += len(sum(input_ids.tolist(), []))
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


def _model(meta_safe: bool = False) -> DataDependentLlama:
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                            attention_dropout=0.1, tie_word_embeddings=False)
    config._attn_implementation = "eager"  # its dropout draws from the random generator
    torch.manual_seed(0)
    model = DataDependentLlama(config).float()
    model.meta_safe = meta_safe
    model.config.use_cache = False
    return model


def _user_state(model: nn.Module) -> dict:
    """What planning must not change, as values and object identities."""
    return {
        "training": {n: m.training for n, m in model.named_modules()},
        "checkpointing": {n: (m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None))
                          for n, m in model.named_modules() if hasattr(m, "gradient_checkpointing")},
        "hooks": {n: [dict(getattr(m, t)) for t in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks")]
                  for n, m in model.named_modules()},
        "buffers": {n: (b, b.clone()) for n, b in model.named_buffers()},
        "grads": {n: (p.grad, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
        "attributes": {n: sorted(vars(m)) for n, m in model.named_modules()},
        "rng": torch.get_rng_state(),
    }


def _assert_same(before: dict, after: dict) -> None:
    assert after["training"] == before["training"]
    for name, (flag, func) in before["checkpointing"].items():
        assert after["checkpointing"][name][0] == flag and after["checkpointing"][name][1] is func, name
    assert after["hooks"] == before["hooks"]
    assert after["attributes"] == before["attributes"]
    for name, (buf, values) in before["buffers"].items():
        now, _ = after["buffers"][name]
        assert now is buf and torch.equal(now, values), name
    for name, (grad, values) in before["grads"].items():
        now, _ = after["grads"][name]
        assert now is grad and (grad is None or torch.equal(now, values)), name
    assert torch.equal(after["rng"], before["rng"])


def test_the_real_step_fallback_leaves_the_model_as_found_and_warns_once(monkeypatch) -> None:
    model = _model()
    model.train()
    model.model.norm.eval()  # frozen statistics: the user's choice, not the top module's
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # gradients the user has not used yet
    model.model.norm.bn.running_mean.add_(0.5)  # statistics no fresh BatchNorm has
    calls = {"forward": 0, "pre": 0, "backward": 0, "grad": 0}

    def count(kind):
        def hook(*args):
            calls[kind] += 1
        return hook

    layer = model.model.layers[0]
    layer.register_forward_hook(count("forward"))
    layer.mlp.register_forward_pre_hook(count("pre"))
    model.lm_head.register_full_backward_hook(count("backward"))
    layer.mlp.up_proj.weight.register_post_accumulate_grad_hook(count("grad"))
    before = _user_state(model)
    monkeypatch.setattr(needs, "_warned", [])

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plans = [hfe.ElixirPlan.simple(model, 1, activation_checkpointing=True, example_batch=(2, 8))
                 for _ in range(2)]

    _assert_same(before, _user_state(model))
    assert model.is_activation_checkpointing and not model.model.norm.training and model.training
    assert calls == {"forward": 0, "pre": 0, "backward": 0, "grad": 0}
    real = [w for w in seen if issubclass(w.category, needs.RealStepWarning)]
    assert len(real) == 1, [str(w.message) for w in seen]
    text = str(real[0].message)
    assert "DataDependentLlama" in text and "Cannot copy out of meta tensor" in text and "one real forward and backward" in text
    # the hooks are put back, not lost: the next real step reaches every one of them
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(n >= 1 for n in calls.values()), calls
    # and the fallback traced what a meta trace of the same model finds
    reference = hfe.ElixirPlan.simple(_model(meta_safe=True), 1, activation_checkpointing=True, example_batch=(2, 8))
    for plan in plans:
        assert plan.min_rcache_blocks == reference.min_rcache_blocks
        assert plan.borrowed == reference.borrowed


def test_a_failing_real_step_still_leaves_the_model_as_found(monkeypatch) -> None:
    """Planning refuses a model whose real step fails too, and puts it back all the same."""
    model = _model()
    model.model.norm.eval()
    model.model.norm.fail = True  # raises once the statistics moved
    before = _user_state(model)
    monkeypatch.setattr(needs, "_warned", [])
    with pytest.warns(needs.RealStepWarning), pytest.raises(hfe.PlanError, match="could not trace"):
        hfe.ElixirPlan.simple(model, 1, example_batch=(2, 8))
    _assert_same(before, _user_state(model))


def test_planning_a_meta_copy_does_not_reach_the_users_hooks() -> None:
    """A model the meta device can run: its copy's step calls none of the user's hooks."""
    model = _model(meta_safe=True)
    calls = []
    model.model.layers[0].register_forward_hook(lambda *args: calls.append("forward"))
    model.model.layers[0].mlp.down_proj.weight.register_hook(lambda grad: calls.append("grad"))
    hfe.ElixirPlan.simple(model, 1, example_batch=(2, 8))
    assert calls == []


def test_hooks_belong_to_the_package_that_defined_them() -> None:
    """Library hooks (they change what the model computes) are kept; the user's are not."""
    from transformers.modeling_utils import PreTrainedModel

    def mine(*args):
        return None

    assert is_user_hook(mine) and is_user_hook(lambda *a: None) and is_user_hook(functools.partial(mine, 1))
    assert not is_user_hook(PreTrainedModel.enable_input_require_grads)
    assert not is_user_hook(functools.partial(torch.nn.functional.relu))
    assert not is_user_hook(nn.utils.spectral_norm(nn.Linear(2, 2))._forward_pre_hooks.popitem()[1])
