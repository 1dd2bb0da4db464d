"""Tiny configs for every causal-LM architecture transformers ships, built generically.

Each architecture's config class is instantiated with its defaults and then shrunk by
rules keyed on attribute *names* (sizes, layer counts, heads, experts, dropout), never on
the model type, so a new transformers release brings its new architectures into the sweep
with no edit here. What cannot be made into a small decoder-only LM trained from
``input_ids`` is reported by ``build_tiny`` as a ``Skip`` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB = 96
HIDDEN = 32
HEADS = 4
LAYERS = 2
TOKEN_LOW = 4  # input ids are drawn from [TOKEN_LOW, TOKEN_HIGH): no special token among them
TOKEN_HIGH = VOCAB - 16

_HIDDEN_KEYS = {
    "hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim", "hidden_dim",
    "n_embed", "embedding_size", "word_embed_proj_dim", "emb_dim", "d_embed",
}
_FFN_KEYS = {
    "intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "inner_hidden_size",
    "decoder_ffn_dim", "encoder_ffn_dim", "dim_ff", "mlp_dim", "hidden_act_dim", "d_inner",
}
_SMALL_FFN_KEYS = {
    "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
    "moe_ffn_hidden_size", "ffn_hidden_size_moe",
}
_LAYER_KEYS = {
    "num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
    "num_decoder_layers",
}
_HEAD_KEYS = {
    "num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
    "encoder_attention_heads",
}
_KV_HEAD_KEYS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"}
_EXPERT_KEYS = {
    "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "n_experts",
    "num_routed_experts",
}
_TOPK_KEYS = {"num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_selected_experts"}


@dataclass
class Skip:
    """An architecture the sweep cannot train, and why."""

    reason: str


@dataclass
class NotSmall:
    """The generic rules left the model large: a failure of this file, not a skip."""

    reason: str


MAX_PARAMS = 2_000_000


_DERIVED_KEYS = {"qk_head_dim"}  # = qk_nope_head_dim + qk_rope_head_dim


@dataclass
class _Before:
    """Sizes of the default config, to recognise attributes that repeat them."""

    layers: int | None
    hidden: int | None
    ffn: int | None
    heads: int | None

    @classmethod
    def of(cls, values: dict) -> "_Before":
        def first(keys):
            return next((values[k] for k in keys if type(values.get(k)) is int), None)

        return cls(first(_LAYER_KEYS), first(_HIDDEN_KEYS), first(_FFN_KEYS), first(_HEAD_KEYS))


def _is_float_noise(key: str) -> bool:
    return "dropout" in key or key.endswith("pdrop") or key == "layerdrop" or "jitter" in key


def _shrunk_int(key: str, value: int, before: _Before) -> int:
    """The small value of one integer attribute (``value`` when no rule applies)."""
    if key in _HIDDEN_KEYS or key.startswith("hidden_size") or key.endswith("embed_dim") or key == "embedding_dim":
        return min(value, HIDDEN)
    if key in _SMALL_FFN_KEYS or ("expert" in key and ("ffn" in key or "size" in key)) or (
            "intermediate_size" in key and "moe" in key):
        return min(value, HIDDEN // 2)
    if key in _FFN_KEYS or "intermediate_size" in key:
        return min(value, 2 * HIDDEN)
    if key in _LAYER_KEYS:
        return min(value, LAYERS)
    if key in _KV_HEAD_KEYS:  # grouped-query attention stays grouped, multi-head stays so
        return HEADS if value == before.heads else (min(value, HEADS // 2) if value > 1 else value)
    if key in _HEAD_KEYS or "num_heads" in key or "n_heads" in key:
        return min(value, HEADS)
    if key.endswith("head_dim") or key in ("kv_channels", "attention_head_dim", "rotary_dim", "d_head"):
        return min(value, HIDDEN // HEADS)
    if "lora_rank" in key:
        return min(value, 16)
    if key in _EXPERT_KEYS or key.endswith("expert_num"):
        return min(value, 4)
    if key in _TOPK_KEYS:
        return min(value, 2)
    if key in ("n_shared_experts", "num_shared_experts"):
        return min(value, 1)
    if key in ("n_group", "topk_group", "num_expert_group"):
        return 1
    if "vocab_size" in key or key.endswith("_vocab"):
        return VOCAB
    if key.endswith("token_id") or key.endswith("token_index"):
        return value if value < VOCAB else VOCAB - 1
    # an attribute that repeats the default hidden or feed-forward width is one of them
    if before.hidden and before.hidden >= 256 and value == before.hidden:
        return HIDDEN
    if before.ffn and before.ffn >= 256 and value == before.ffn:
        return 2 * HIDDEN
    return value


def _per_layer(value: Any) -> bool:
    """A dict of per-layer overrides keyed by layer index."""
    return isinstance(value, dict) and bool(value) and all(str(k).isdigit() for k in value)


def _shrunk_value(key: str, value: Any, before: _Before) -> Any:
    """The small value for one config attribute, or ``value`` when no rule applies."""
    if type(value) is int:
        return _shrunk_int(key, value, before)
    if isinstance(value, float) and _is_float_noise(key):
        return 0.0
    if isinstance(value, list) and before.layers and len(value) == before.layers:
        return value[:LAYERS]  # per-layer lists (layer_types, ...)
    if _per_layer(value):
        return {k: v for k, v in value.items() if int(k) < LAYERS}  # per-layer overrides
    if key == "is_decoder" and value is False:
        return True  # encoder families (BERT, ...) are causal LMs only as decoders
    return value


def _shrunk(values: dict) -> dict:
    """``values`` (a config's ``to_dict()``) with every rule applied, sub-configs included."""
    before = _Before.of(values)
    out = {}
    for key, value in values.items():
        if key in _DERIVED_KEYS:
            continue  # recomputed by the config from the sizes above
        if isinstance(value, dict) and key.endswith("config") and not _per_layer(value):
            out[key] = _shrunk(value)
        else:
            out[key] = _shrunk_value(key, value, before)
    return out


def tiny_config(model_type: str):
    """The config class's defaults with every size shrunk (see the module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    config = cls(**_shrunk(cls().to_dict()))
    config._attn_implementation = "eager"
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def build_tiny(model_type: str, seed: int = 0) -> nn.Module | Skip | NotSmall:
    """A tiny fp32 model of ``model_type`` in training mode, or a Skip saying why not."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if "ConditionalGeneration" in cls_name:
        return Skip("multimodal: its causal-LM class is a conditional-generation model")
    try:
        config = tiny_config(model_type)
    except Exception as exc:  # the config's own validation rejects shrinking
        return Skip(f"tiny config does not build: {type(exc).__name__}: {str(exc)[:120]}")
    if getattr(config, "is_encoder_decoder", False) and not hasattr(config, "is_decoder"):
        return Skip("encoder-decoder")
    try:
        with torch.device("meta"):
            meta = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        size = sum(p.numel() for p in meta.parameters())
        if size > MAX_PARAMS:
            big = max(meta.named_parameters(), key=lambda kv: kv[1].numel())
            modalities = [k for k in ("vision_config", "audio_config") if getattr(config, k, None) is not None]
            if modalities:  # its encoders are not built from the text sizes shrunk here
                return Skip(f"multimodal ({', '.join(modalities)}): {size} parameters after shrinking")
            return NotSmall(f"{size} parameters after shrinking (largest {big[0]} {tuple(big[1].shape)})")
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except Exception as exc:
        return Skip(f"model does not build: {type(exc).__name__}: {str(exc)[:120]}")
    model = model.float().train()
    if hasattr(model, "config"):
        model.config.use_cache = False
    return model


def make_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(TOKEN_LOW, TOKEN_HIGH, (batch, seq), generator=g)


def causal_lm_types() -> list[str]:
    """Every model type with a causal-LM class in the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
