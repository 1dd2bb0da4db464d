"""Tiny causal LMs of several architectures, built from configs (never downloaded)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 96


def _configs() -> dict:
    import transformers as tf

    common = dict(vocab_size=VOCAB, tie_word_embeddings=False)
    return {
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0,
        ),
        "llama": lambda: tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **common,
        ),
        "opt": lambda: tf.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, vocab_size=VOCAB,
        ),
        "gpt_neox": lambda: tf.GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, **common,
        ),
        "qwen2": lambda: tf.Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **common,
        ),
        "mixtral": lambda: tf.MixtralConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
            num_experts_per_tok=2, router_jitter_noise=0.0, **common,
        ),
    }


ARCHS = ["gpt2", "llama", "opt", "gpt_neox", "qwen2", "mixtral"]


def make_model(arch: str, seed: int = 0) -> nn.Module:
    import transformers as tf

    config = _configs()[arch]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.config.use_cache = False
    return model.float()


def offloaded_gpt2(world_size: int, compute_dtype: str = "bfloat16"):
    """A 2-layer GPT-2 (vocabulary 256) seeded 0, in chunks of 16K elements with every
    chunk's optimizer state on the host and ``compute_dtype`` compute (bf16 or fp16): each
    update runs the one-pass host loop (``runtime/host_kernel.py``), which writes the copy
    too. Returns the model and its ``ElixirModule``."""
    import transformers as tf

    import hf_elixir as hfe

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                             bos_token_id=0, eos_token_id=0))
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=1 << 14, offload_fraction=1.0,
                                 compute_dtype=compute_dtype)
    return model, hfe.ElixirModule(model, plan)


def make_batch(batch: int = 12, seq: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


# ---------------------------------------------------------------------- a dynamic MoE
class _Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _MoE(nn.Module):
    """Top-1 routing over a ModuleList: experts nobody routes to do not run at all."""

    def __init__(self, d: int, n_experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, n_experts)
        with torch.no_grad():  # the last expert is (almost) never picked: its grads stay None
            self.router.bias[-1] = -20.0
        self.experts = nn.ModuleList(_Expert(d) for _ in range(n_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().flatten()
            if idx.numel() == 0:
                continue
            out = out.index_add(0, idx, expert(flat[idx]) * weight[idx, None])
        return out.reshape_as(x)


class DynamicMoELM(nn.Module):
    """A small LM whose experts run data-dependently; ``loss`` like HF models return."""

    def __init__(self, d: int = 16, n_experts: int = 6, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(_MoE(d, n_experts) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.skip_layers: set[int] = set()

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            if i not in self.skip_layers:
                h = h + layer(h)
        logits = self.head(self.norm(h))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
            )
        return {"loss": loss, "logits": logits}


def make_dynamic_moe(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return DynamicMoELM()


class UniformLM(nn.Module):
    """Four parameters of exactly 3072 elements: with chunk_size 3072, four equal chunks."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.mix = nn.ModuleList(nn.Linear(d, VOCAB, bias=False) for _ in range(2))
        self.unmix = nn.Linear(VOCAB, d, bias=False)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        h = h + self.unmix(torch.relu(self.mix[0](h)))
        logits = self.mix[1](self.norm(h))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}
