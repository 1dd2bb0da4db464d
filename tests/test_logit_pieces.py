"""The LM head and its loss in pieces (issue 61, part 2): the whole logits never exist.

A tiny Llama-style model (hidden 16, two layers) with a vocabulary of 32,000 at 4,096 tokens:
its whole fp32 logits are 131M elements (0.5 GB), computed once here, as the reference
(plain PyTorch, no hf_elixir), under a dispatch-mode tracker that records the largest
tensor with a vocabulary-sized dimension. The same batch then trains through the real
runtime, directly, under the Transformers Trainer and under TRL's SFTTrainer, with logits in
pieces of 512 tokens: the tracker must never see more than one piece, and the loss and
every gradient must equal the reference's within 1e-6 relative (fp32). bf16 is held to one
bf16 rounding (2**-8 relative): the equivalence suite has no bf16 constant of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hf_elixir as hfe
from harness import run_distributed
from hf_elixir.integrations.logit_pieces import LogitPieceError
from hf_elixir.runtime.logit_pieces import loss_in_pieces
from integration_helpers import SCRIPTS
from loops import gathered_gradients

VOCAB, SEQ, PIECE = 32_000, 4_096, 512
FP32_TOL = 1e-6
BF16_TOL = 2 ** -8  # one bf16 rounding


class LargestLogits(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns that has a dimension of
    at least ``vocab`` (logits, their fp32 copies and gradients; not the (vocab, hidden)
    weights, which are far smaller than a piece here)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and max(t.shape) >= self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def llama(vocab: int = VOCAB, seq: int = SEQ, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=seq, vocab_size=vocab,
                            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype)
    model.config.use_cache = False
    return model.train()


def tokens(batch: int = 1, seq: int = SEQ, vocab: int = VOCAB, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``a``'s distance from the reference ``b``, relative to ``b``'s norm."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def shard_grads(emodel) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient as the runtime holds it (one rank: the shards are
    whole; frozen chunks have none)."""
    return {s.name: c.grad_shard[s.offset:s.offset + s.numel].view(s.shape).clone()
            for c in emodel.chunks if not c.frozen for s in c.slots}


def assert_equal_grads(got: dict, want: dict, tol: float) -> None:
    assert set(got) == set(want)
    worst = max(((rel(got[n], want[n]), n) for n in want))
    assert worst[0] <= tol, f"{worst[1]}: gradient off by {worst[0]:.2e} relative (tolerance {tol:.0e})"


@pytest.fixture(scope="module")
def whole():
    """The reference: plain PyTorch with whole logits, once (loss, gradients, largest logits)."""
    model, ids = llama(), tokens()
    with LargestLogits(VOCAB) as seen:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return {"ids": ids, "loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "largest": seen.largest}


# ---------------------------------------------------------------------- the function alone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_in_pieces_is_transformers_causal_lm_loss(dtype) -> None:
    """Against ForCausalLMLoss on whole logits: ignored labels, num_items_in_batch (summed
    then divided, the Trainer's accumulation), pre-shifted labels, a bias, pieces that do not
    divide the tokens."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    vocab, hidden = 211, 24
    h = torch.randn(3, 41, hidden).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.2).to(dtype).requires_grad_()
    b = torch.randn(vocab).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (3, 41))
    labels[0, :17] = -100
    labels[2, 30:] = -100
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(97)}, {"shift_labels": shifted}):
        want = ForCausalLMLoss(F.linear(h, w, b), None if "shift_labels" in kwargs else labels, vocab, **kwargs)
        want_grads = torch.autograd.grad(want, (h, w, b))
        got = loss_in_pieces(h, w, b, None if "shift_labels" in kwargs else labels, 13, **kwargs)
        got_grads = torch.autograd.grad(got, (h, w, b))
        assert abs(got.item() - want.item()) <= tol * abs(want.item()), kwargs
        for g, r in zip(got_grads, want_grads):
            assert rel(g, r) <= tol, kwargs


# ---------------------------------------------------------------------- through the runtime
def test_32k_vocab_at_4096_tokens_trains_one_piece_at_a_time(whole) -> None:
    """The real runtime (one rank): at most one piece of logits ever exists, and the loss and
    every gradient are the whole computation's within 1e-6; the output carries no logits."""
    assert whole["largest"] >= SEQ * VOCAB  # the tracker sees whole logits where they exist
    model = llama()
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model), logit_piece_tokens=PIECE)
    assert emodel.logit_pieces.active, emodel.logit_pieces.note
    with LargestLogits(VOCAB) as seen:
        out = emodel(input_ids=whole["ids"], labels=whole["ids"])
        out.loss.backward()
    assert seen.largest <= PIECE * VOCAB, f"{seen.largest} elements of logits, a piece is {PIECE * VOCAB}"
    assert out.logits is None
    assert abs(out.loss.item() - whole["loss"]) <= FP32_TOL * whole["loss"]
    assert_equal_grads(shard_grads(emodel), whole["grads"], FP32_TOL)


def test_bf16_equals_the_whole_computation() -> None:
    """bf16 through the runtime against the plain bf16 model with whole logits (a prompt
    masked out of the labels), to one bf16 rounding."""
    seq = 1024
    ids = tokens(seq=seq)
    labels = ids.clone()
    labels[:, :300] = -100
    ref = llama(seq=seq, dtype=torch.bfloat16)
    loss = ref(input_ids=ids, labels=labels).loss
    loss.backward()
    model = llama(seq=seq, dtype=torch.bfloat16)
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, compute_dtype="bfloat16"), logit_piece_tokens=200)
    with LargestLogits(VOCAB) as seen:
        out = emodel(input_ids=ids, labels=labels)
        out.loss.backward()
    assert seen.largest <= 200 * VOCAB
    assert abs(out.loss.item() - loss.item()) <= BF16_TOL * loss.item()
    assert_equal_grads(shard_grads(emodel), {n: p.grad for n, p in ref.named_parameters()}, BF16_TOL)


def _two_ranks(rank: int, world_size: int) -> dict:
    """One rank of a 2-rank run with as few rCache blocks as the model allows (chunks are
    evicted and gathered again within the step) and the model's own activation
    checkpointing on."""
    import torch.distributed as dist

    model = llama(vocab=2048, seq=256)
    least = hfe.ElixirPlan.simple(model, world_size, chunk_size=4096, activation_checkpointing=True).min_rcache_blocks
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=4096, rcache_blocks=least,
                                 activation_checkpointing=True)
    emodel = hfe.ElixirModule(model, plan, logit_piece_tokens=100)
    ids = tokens(batch=2, seq=256, vocab=2048)[rank:rank + 1]
    labels = ids.clone()
    labels[:, :40] = -100
    out = emodel(input_ids=ids, labels=labels)
    out.loss.backward()
    losses = [torch.zeros(()) for _ in range(world_size)]
    dist.all_gather(losses, out.loss.detach())
    grads = gathered_gradients(emodel, model)["grads"]
    return {"losses": [x.item() for x in losses], "grads": grads if rank == 0 else None,
            "spare": plan.n_chunks - plan.rcache_blocks, "logits": out.logits, "active": emodel.logit_pieces.active}


def test_two_ranks_over_gloo_equal_the_whole_computation() -> None:
    """World size 2 through the real runtime and its collectives: each rank's loss and the
    averaged gradients equal plain PyTorch's on each rank's half of the batch."""
    results = run_distributed(_two_ranks, 2)
    got = results[0]
    assert got["active"] and got["logits"] is None and got["spare"] > 0
    model = llama(vocab=2048, seq=256)
    ids = tokens(batch=2, seq=256, vocab=2048)
    labels = ids.clone()
    labels[:, :40] = -100
    losses = []
    for r in range(2):
        loss = model(input_ids=ids[r:r + 1], labels=labels[r:r + 1]).loss
        (loss / 2).backward()
        losses.append(loss.item())
    for a, b in zip(got["losses"], losses):
        assert abs(a - b) <= FP32_TOL * b
    assert_equal_grads(got["grads"], {n: p.grad for n, p in model.named_parameters()}, FP32_TOL)


def test_lora_adapters_train_in_pieces() -> None:
    """A PEFT model (LoRA on the attention, the head untouched): the base's head and loss run
    in pieces under the adapter, and the adapters' gradients are plain PEFT's."""
    from peft import LoraConfig, get_peft_model

    def adapted():
        model = llama(vocab=512, seq=64)
        torch.manual_seed(1)
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))

    ids = tokens(batch=2, seq=64, vocab=512)
    ref = adapted()
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    model = adapted()
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model), logit_piece_tokens=16)
    with LargestLogits(512) as seen:
        out = emodel(input_ids=ids, labels=ids)
        out.loss.backward()
    assert emodel.logit_pieces.active and out.logits is None and seen.largest <= 16 * 512
    assert abs(out.loss.item() - loss.item()) <= FP32_TOL * loss.item()
    got = {n: g for n, g in shard_grads(emodel).items() if "lora_" in n}
    assert got and len(got) == 8
    assert_equal_grads(got, {n: p.grad for n, p in ref.named_parameters() if "lora_" in n}, FP32_TOL)


def test_a_bad_piece_size_is_refused_before_anything_changes() -> None:
    from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin

    with pytest.raises(ElixirConfigError, match="logit_piece_tokens"):
        ElixirPlugin(logit_piece_tokens=-1)
    with pytest.raises(ElixirConfigError, match="logit_piece_tokens"):
        ElixirPlugin(logit_piece_tokens="many")
    model = llama(vocab=96, seq=32)
    with pytest.raises(hfe.PlanError, match="logit_piece_tokens"):
        hfe.ElixirModule(model, hfe.ElixirPlan.simple(model), logit_piece_tokens=-5)
    assert not hasattr(model, "_hf_elixir_wrapped")  # untouched: it can still be wrapped


# ---------------------------------------------------------------------- which models, what they return
def test_whole_logits_where_a_caller_needs_them() -> None:
    """Evaluation, a forward without a graph and a forward without labels return the whole
    logits, equal to the plain model's; only a training forward given labels has none."""
    ids = tokens(batch=2, seq=32, vocab=96)
    ref, model = llama(vocab=96, seq=32), llama(vocab=96, seq=32)
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model), logit_piece_tokens=7)
    assert emodel(input_ids=ids, labels=ids).logits is None
    with torch.no_grad():
        torch.testing.assert_close(emodel(input_ids=ids, labels=ids).logits, ref(input_ids=ids).logits)
    torch.testing.assert_close(emodel(input_ids=ids).logits, ref(input_ids=ids).logits)
    emodel.eval()
    ref.eval()
    out = emodel(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, ref(input_ids=ids).logits)
    torch.testing.assert_close(out.loss, ref(input_ids=ids, labels=ids).loss)


def test_heads_and_losses_of_another_shape_run_whole_and_say_why() -> None:
    """A soft-capped head, a custom loss, LoRA on the head: pieces are not applied, the note
    says why, and a training forward returns whole logits as before."""
    from peft import LoraConfig, get_peft_model

    capped = llama(vocab=96, seq=32)
    capped.config.final_logit_softcapping = 30.0
    custom = llama(vocab=96, seq=32)
    custom.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    adapted = get_peft_model(llama(vocab=96, seq=32), LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    ids = tokens(batch=1, seq=32, vocab=96)
    for model, why in ((capped, "final_logit_softcapping=30.0"), (custom, "not ForCausalLMLoss"),
                       (adapted, "not a plain Linear")):
        emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model), logit_piece_tokens=7)
        assert not emodel.logit_pieces.active and why in emodel.logit_pieces.note, emodel.logit_pieces.note
        assert emodel(input_ids=ids, labels=ids).logits.shape == (1, 32, 96)


class NoLoss(tf.LlamaForCausalLM):
    """Takes labels but computes no loss: its logits are all it returns."""

    def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        return tf.modeling_outputs.CausalLMOutputWithPast(logits=self.lm_head(self.model(input_ids).last_hidden_state))


def test_logits_changed_after_the_head_without_notice_are_refused() -> None:
    """A hook that changes the head's output (the loss would see other logits than the head
    made), or a forward that hands the head's logits to no loss (they would be empty), is an
    error naming the way out, not a silently different result; whole logits run."""
    ids = tokens(batch=1, seq=32, vocab=96)
    model = NoLoss(llama(vocab=96, seq=32).config).train()
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model), logit_piece_tokens=7)
    with pytest.raises(LogitPieceError, match="did not hand its head's logits"):
        emodel(input_ids=ids, labels=ids)
    for tokens_per_piece in (7, 0):
        model = llama(vocab=96, seq=32)
        model.lm_head.register_forward_hook(lambda module, args, out: out * 2)
        emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model), logit_piece_tokens=tokens_per_piece)
        if tokens_per_piece:
            with pytest.raises(LogitPieceError, match="logit_piece_tokens to 0"):
                emodel(input_ids=ids, labels=ids)
        else:
            assert emodel(input_ids=ids, labels=ids).loss.requires_grad


# ---------------------------------------------------------------------- the Trainer and TRL
def _train(trainer_class, args, data, tmp_path: Path, **kwargs) -> tuple[dict, int, list]:
    """One SGD step of ``trainer_class`` under the tracker: the gradients it steps with (read
    from the runtime's shards, before the step), the largest logits, the log."""
    grads: dict = {}

    class Grab(tf.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            modules = trainer.accelerator._elixir_modules
            assert modules, "hf_elixir is not running"
            grads.update(shard_grads(modules[0]))

    trainer = trainer_class(model=llama(), args=args, train_dataset=data, callbacks=[Grab()], **kwargs)
    with LargestLogits(VOCAB) as seen:
        trainer.train()
    return grads, seen.largest, trainer.state.log_history


COMMON = dict(max_steps=1, per_device_train_batch_size=1, learning_rate=1e-3, optim="sgd", max_grad_norm=0.0,
              report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, use_cpu=True)


def test_under_the_trainer(whole, tmp_path) -> None:
    """ElixirTrainer with the elixir option logit_piece_tokens: the step's gradients are the
    whole computation's, and no more than one piece of logits exists."""
    from datasets import Dataset

    from hf_elixir.integrations.trainer import ElixirTrainer, ElixirTrainingArguments

    ids = whole["ids"][0].tolist()
    data = Dataset.from_dict({"input_ids": [ids], "labels": [ids]})
    args = ElixirTrainingArguments(output_dir=str(tmp_path), elixir=True, elixir_config=(
        f'{{"logit_piece_tokens": {PIECE}, "offload": "none"}}'), **COMMON)
    grads, largest, log = _train(ElixirTrainer, args, data, tmp_path)
    assert largest <= PIECE * VOCAB
    assert abs(log[0]["loss"] - whole["loss"]) <= FP32_TOL * whole["loss"]
    assert_equal_grads(grads, whole["grads"], FP32_TOL)


def test_under_trl_sft_trainer(whole, tmp_path, monkeypatch) -> None:
    """TRL's SFTTrainer (its own fused head) on hf_elixir with logit pieces: TRL's logits
    tiles are bounded to one piece, and its loss and gradients are the whole computation's."""
    import importlib.util

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_elixir.integrations.trainer import ElixirTrainer

    spec = importlib.util.spec_from_file_location("trl_sft_script", SCRIPTS / "trl_sft.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # what `hf-elixir launch` hands a worker: the switch and the options, as environment
    for key, value in {"ACCELERATE_USE_ELIXIR": "true", "ELIXIR_OFFLOAD": "none",
                       "ELIXIR_LOGIT_PIECE_TOKENS": str(PIECE)}.items():
        monkeypatch.setenv(key, value)

    class ElixirSFTTrainer(SFTTrainer, ElixirTrainer):  # what the launcher's bootstrap makes of SFTTrainer
        pass

    data = Dataset.from_dict({"input_ids": [whole["ids"][0].tolist()]})
    args = SFTConfig(output_dir=str(tmp_path), bf16=False, max_length=SEQ, gradient_checkpointing=False, **COMMON)
    grads, largest, log = _train(ElixirSFTTrainer, args, data, tmp_path, processing_class=script.build_tokenizer())
    assert largest <= PIECE * VOCAB
    assert abs(log[0]["loss"] - whole["loss"]) <= FP32_TOL * whole["loss"]
    assert_equal_grads(grads, whole["grads"], FP32_TOL)
