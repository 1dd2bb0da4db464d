"""Configs of well-known models, written out so planning needs no network and no weights.

Figures are those of the published config.json files (hidden size, layers, heads, FFN size,
vocabulary, positions).
"""

from __future__ import annotations

from typing import Any, Callable


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> Callable[[], Any]:
    def make():
        from transformers import GPT2Config

        return GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=50257, n_positions=1024)

    return make


def _llama(hidden: int, layers: int, heads: int, ffn: int, kv: int | None = None, vocab: int = 32000,
           positions: int = 4096) -> Callable[[], Any]:
    def make():
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv or heads, intermediate_size=ffn, vocab_size=vocab,
                           max_position_embeddings=positions, tie_word_embeddings=False)

    return make


KNOWN_CONFIGS: dict[str, Callable[[], Any]] = {
    "gpt2": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    "llama-2-7b": _llama(4096, 32, 32, 11008),
    "llama-2-13b": _llama(5120, 40, 40, 13824),
    "llama-2-70b": _llama(8192, 80, 64, 28672, kv=8),
}
_ALIASES = {
    "openai-community/gpt2": "gpt2", "openai-community/gpt2-medium": "gpt2-medium",
    "openai-community/gpt2-large": "gpt2-large", "openai-community/gpt2-xl": "gpt2-xl",
    "meta-llama/llama-2-7b-hf": "llama-2-7b", "meta-llama/llama-2-13b-hf": "llama-2-13b",
    "meta-llama/llama-2-70b-hf": "llama-2-70b", "llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b",
}


def known_config(name: str):
    """The config of a well-known model by short name or hub id, or None."""
    key = name.lower().strip()
    key = _ALIASES.get(key, key)
    make = KNOWN_CONFIGS.get(key)
    if make is None:
        return None
    cfg = make()
    cfg._name_or_path = name
    return cfg
