"""Tiny configs for every causal-LM architecture transformers ships, built generically.

Each architecture's config class is instantiated with its defaults and then shrunk by
rules keyed on attribute *names* (sizes, layer counts, heads, experts, state-space widths,
dropout), never on the model type, so a new transformers release brings its new
architectures into the sweep with no edit here. Sizes that must agree stay in agreement:
a Mamba block's inner width (expand x hidden) equals its heads x head width, widths that
repeat the hidden width anywhere in the config (an adapter's output) shrink with it, a
hybrid keeps one layer of each kind ("linear_attention" and "full_attention"), counts of
kinds of layers that add up to the stack shrink together. Where a config class's defaults
leave a size unset (None) although its model needs one, a second pass fills it in
(``RULES``: the first choice whose model builds is kept).

One exception is keyed on the model type: ``CHECKPOINT_VALUES``, what released checkpoints
set and the class's defaults leave out with nothing a rule could derive it from (which
kind each layer of lfm2_moe is). What cannot be made into a small decoder-only LM trained
from ``input_ids`` is reported by ``build_tiny`` as a ``Skip`` with the reason: a
conditional-generation (multimodal) class, an encoder-decoder, a speculative-decoding
drafter that runs on a target model's keys and values.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

VOCAB = 96
HIDDEN = 32
HEADS = 4
LAYERS = 2
SEQ = 16  # the sweep's sequence length (arch_sweep.py): factored positions must multiply to it
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
    # xLSTM counts its layers as blocks; HRM stacks this many layers in each of its two
    # recurrent modules (left at 32 and 16 they were a tenth of the sweep's time)
    "num_blocks", "num_layers_per_stack",
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
_TOPK_KEYS = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "moe_k",
              "num_selected_experts"}


@dataclass
class Skip:
    """An architecture the sweep cannot train, and why."""

    reason: str


@dataclass
class NotSmall:
    """The generic rules left the model large: a failure of this file, not a skip."""

    reason: str


MAX_PARAMS = 2_000_000


# recomputed by the config from what is shrunk: qk_head_dim = qk_nope_head_dim +
# qk_rope_head_dim; hybrid_layer_ids = the indices of the "hybrid" entries of layer_types
_DERIVED_KEYS = {"qk_head_dim", "hybrid_layer_ids"}


@dataclass
class _Before:
    """Sizes of the default config, to recognise attributes that repeat them, and how many
    layers the tiny one gets (``target``)."""

    layers: int | None
    hidden: int | None
    ffn: int | None
    heads: int | None
    target: int = LAYERS
    parts: tuple[str, ...] = ()  # layer counts that add up to the whole stack (see ``of``)
    rules: "Rules" = None
    widths: frozenset = frozenset()  # hidden widths (>= 256) of every part of the config
    positions: int | None = None    # the default longest sequence
    experts: bool = False           # it routes tokens to experts
    languages: Any = None           # the languages it has adapters for

    @classmethod
    def of(cls, values: dict, rules: "Rules") -> "_Before":
        def first(keys):  # in a fixed order: a set's order changes with the hash seed
            return next((values[k] for k in sorted(keys) if type(values.get(k)) is int), None)

        before = cls(first(_LAYER_KEYS), first(_HIDDEN_KEYS), first(_FFN_KEYS), first(_HEAD_KEYS), rules=rules,
                     positions=values.get("max_position_embeddings"), languages=values.get("languages"),
                     experts=any(type(values.get(k)) is int and values[k] > 1 for k in _EXPERT_KEYS))
        if not before.layers:
            return before
        # counts of kinds of layers that add up to the stack (input, recurrent and output
        # layers): two layers of each (a config may store each layer as two blocks), so
        # the stack is twice as deep as there are kinds
        parts = tuple(k for k, v in values.items() if k not in _LAYER_KEYS and type(v) is int and v > 0
                      and re.fullmatch(r"(n|num)_\w+_layers", k))
        if len(parts) >= 2 and sum(values[k] for k in parts) == before.layers:
            before.parts = parts
            before.target = sum(min(values[k], 2) for k in parts)
        # the last layers reuse keys and values of an earlier layer of their kind: one such
        # layer, after one layer of every kind that produces them
        shared = values.get("num_kv_shared_layers")
        if type(shared) is int and 0 < shared < before.layers:
            before.target = max(LAYERS, len(_kinds(values.get("layer_types"))) + 1)
        return before


@dataclass(frozen=True)
class Rules:
    """The choices ``tiny_config`` tries in turn (``RULES``), keeping the first whose model
    builds: a hybrid's per-layer kinds kept, or its first layers only (some kinds need
    settings the defaults leave unset); sizes the defaults leave unset (None) filled in, or not
    (where None means "derive it" the config does so itself)."""

    keep_kinds: bool = True
    fill_unset: bool = False


RULES = (Rules(True, False), Rules(True, True), Rules(False, False), Rules(False, True))


def _kinds(value: Any) -> list:
    """The distinct entries of a per-layer list of kinds (strings), in order of appearance."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return []
    return list(dict.fromkeys(value))


def _first_layers(value: list, n: int, keep_kinds: bool = True) -> list:
    """``n`` entries of a per-layer list: for a list of kinds ("linear_attention",
    "full_attention"), the first layer of each kind before the others, in their order,
    so that a tiny hybrid keeps every kind of layer; other lists are cut."""
    if not _kinds(value) or not keep_kinds:
        return value[:n]
    chosen = sorted(value.index(kind) for kind in _kinds(value))[:n]
    rest = [i for i in range(len(value)) if i not in chosen]
    return [value[i] for i in sorted(chosen + rest[: n - len(chosen)])]


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
        return min(value, before.target)
    if key in before.parts:
        return min(value, 2)
    if key == "num_kv_shared_layers" and before.layers and 0 < value < before.layers:
        return 1
    if key in _KV_HEAD_KEYS or key.endswith("num_key_value_heads"):  # grouped stays grouped, multi-head so
        return HEADS if value == before.heads else (min(value, HEADS // 2) if value > 1 else value)
    if key in _HEAD_KEYS or "num_heads" in key or "n_heads" in key:
        return min(value, HEADS)
    if key.endswith("head_dim") or key in ("kv_channels", "attention_head_dim", "rotary_dim", "d_head"):
        return min(value, HIDDEN // HEADS)
    # state-space (Mamba) blocks: their inner width is expand * hidden and must equal
    # heads * head width, so the expansion goes to 1 and the head width to HIDDEN // HEADS
    if key == "expand" or key.endswith("_expand"):
        return min(value, 1)
    if key.endswith("d_head") or key.endswith("headdim"):
        return min(value, HIDDEN // HEADS)
    if "mamba" in key and key.endswith("heads"):
        return min(value, HEADS)
    if key.endswith("d_ssm"):
        return min(value, HIDDEN)
    if key.endswith("d_state") or key.endswith("state_size"):
        return min(value, 16)
    if (key in ("chunk_size", "mamba_chunk_size") or key.endswith("chunk_length")) and value > 0:
        return min(value, SEQ // 2)  # a scan's or a local attention's chunk: two per sequence
    if key.endswith("n_groups") or key.endswith("ngroups"):  # must divide the (shrunk) heads
        return min(value, 2)
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
    # an attribute that repeats the default hidden or feed-forward width is one of them (the
    # hidden width of any part of the config: an adapter's output is the text width)
    if before.hidden and before.hidden >= 256 and value == before.hidden or value in before.widths:
        return HIDDEN
    if "hidden" in key and before.hidden and before.hidden >= 256 and value == 2 * before.hidden:
        return 2 * HIDDEN  # a width of two hidden states side by side (zamba's attention input)
    if before.ffn and before.ffn >= 256 and value == before.ffn:
        return 2 * HIDDEN
    return value


def _per_layer(value: Any) -> bool:
    """A dict of per-layer overrides keyed by layer index."""
    return isinstance(value, dict) and bool(value) and all(str(k).isdigit() for k in value)


def _unset_size(key: str) -> int | None:
    """The tiny value of a size the config's defaults leave unset (None) although its model
    needs it (a head width, a count of heads or experts), or None when ``key`` is no size."""
    if key.endswith("head_dim"):
        return HIDDEN // HEADS
    if key in _KV_HEAD_KEYS or key.endswith("kv_heads"):
        return HEADS
    if key in _HEAD_KEYS or "num_heads" in key or "n_heads" in key:
        return HEADS
    if key in _EXPERT_KEYS:
        return 4
    if key in _TOPK_KEYS:
        return 2
    if key in ("n_shared_experts", "num_shared_experts"):
        return 1
    if "intermediate_size" in key:
        return HIDDEN // 2 if ("moe" in key or "expert" in key) else 2 * HIDDEN
    return None


def _factors(total: int, n: int) -> list[int]:
    """``n`` near-equal powers of two whose product is ``total`` (a power of two)."""
    out = [1] * n
    i = 0
    while math.prod(out) < total:
        out[i % n] *= 2
        i += 1
    return out


def _shrunk_ints(value: list, before: _Before) -> list | None:
    """A list of sizes that factors a whole: widths adding up to the hidden width (axial
    position embeddings) scaled to add up to HIDDEN; a grid of positions multiplying to
    the longest sequence, made to multiply to SEQ (such a model trains on exactly that
    length). None when ``value`` is neither."""
    if len(value) < 2 or not all(type(v) is int and v > 0 for v in value):
        return None
    if before.hidden and sum(value) == before.hidden:
        scaled = [max(1, v * HIDDEN // before.hidden) for v in value]
        scaled[-1] += HIDDEN - sum(scaled)
        return scaled
    if before.positions and math.prod(value) == before.positions:
        return _factors(SEQ, len(value))
    return None


def _shrunk_value(key: str, value: Any, before: _Before) -> Any:
    """The small value for one config attribute, or ``value`` when no rule applies."""
    if value is None and before.rules.fill_unset and _unset_size(key) is not None:
        return _unset_size(key)
    if value is None and key == "hash_seed":
        return 0  # random hashing (LSH attention) draws its rotations alike in every forward
    if value is None and key in _TOPK_KEYS and before.experts:
        return 2  # experts, and no count of them per token: routing cannot run without one
    if value is None and key == "default_language" and isinstance(before.languages, list) and before.languages:
        return before.languages[0]  # per-language adapters (X-MOD) run for one language
    factors = _shrunk_ints(value, before) if isinstance(value, list) else None
    if factors is not None:
        return factors
    if type(value) is int:
        return _shrunk_int(key, value, before)
    if isinstance(value, float) and _is_float_noise(key):
        return 0.0
    if isinstance(value, list) and before.layers and len(value) == before.layers:
        # per-layer lists (layer_types, per-layer widths, ...)
        cut = _first_layers(value, before.target, before.rules.keep_kinds)
        return [_shrunk_int(key, v, before) if type(v) is int else v for v in cut]
    if _per_layer(value):
        return {k: v for k, v in value.items() if int(k) < before.target}  # per-layer overrides
    if key == "is_decoder" and value is False:
        return True  # encoder families (BERT, ...) are causal LMs only as decoders
    return value


def _hidden_widths(values: dict) -> set[int]:
    """The hidden widths (of 256 and more) of ``values`` and of its sub-configs."""
    found = {v for k, v in values.items() if k in _HIDDEN_KEYS and type(v) is int and v >= 256}
    for key, value in values.items():
        if isinstance(value, dict) and key.endswith("config") and not _per_layer(value):
            found |= _hidden_widths(value)
    return found


def _shrunk(values: dict, rules: Rules = RULES[0], widths: frozenset | None = None) -> dict:
    """``values`` (a config's ``to_dict()``) with every rule applied, sub-configs included."""
    widths = frozenset(_hidden_widths(values)) if widths is None else widths
    before = _Before.of(values, rules)
    before.widths = widths
    out = {}
    for key, value in values.items():
        if key in _DERIVED_KEYS:
            continue  # recomputed by the config from the sizes above
        if isinstance(value, dict) and key.endswith("config") and not _per_layer(value):
            out[key] = _shrunk(value, rules, widths)
        else:
            out[key] = _shrunk_value(key, value, before)
    kinds = _kinds(out.get("layer_types"))
    if rules.fill_unset and out.get("rope_parameters") == {} and kinds:
        # rotary settings keyed by layer kind, none given: each kind gets the default rotation
        out["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in kinds}
    return out


# What a released checkpoint's config sets and this transformers' config class leaves unset,
# with no value a rule could derive: which kind each layer is, an attribute the model reads
# from a sub-config that declares no such field. Not sizes: these are shrunk like any other.
CHECKPOINT_VALUES = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * 16},  # LFM2-8B-A1B mixes both
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},  # dbrx-instruct's attn_config
}


def _with_checkpoint_values(model_type: str, values: dict) -> dict:
    for key, value in CHECKPOINT_VALUES.get(model_type, {}).items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    return values


def tiny_config(model_type: str, rules: Rules = RULES[0]):
    """The config class's defaults with every size shrunk (see the module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    config = cls(**_shrunk(_with_checkpoint_values(model_type, cls().to_dict()), rules))
    config._attn_implementation = "eager"
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def deep_tiny_config(model_type: str, layers: int):
    """The tiny config of ``model_type`` (as ``build_tiny`` builds it) made ``layers`` deep:
    its per-layer lists repeated to the new depth in the same pattern (a hybrid stays a
    hybrid); None when the config cannot be made deeper."""
    import copy

    config, _ = _tiny_on_meta(model_type)
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < 1:
        return None
    deep = copy.deepcopy(config)
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == depth:
            setattr(deep, key, (value * layers)[:layers])
    try:
        deep.num_hidden_layers = layers
    except Exception:  # a config whose depth is derived from other fields
        return None
    return deep


def _tiny_on_meta(model_type: str):
    """(config, meta model) from the first of ``RULES`` whose model builds; the first
    rules' error when none does."""
    import transformers as tf

    first_error = None
    for rules in RULES:
        try:
            config = tiny_config(model_type, rules)
            with torch.device("meta"):
                return config, tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        except Exception as exc:
            first_error = first_error or exc
    raise first_error


def build_tiny(model_type: str, seed: int = 0) -> nn.Module | Skip | NotSmall:
    """A tiny fp32 model of ``model_type`` in training mode, or a Skip saying why not."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in CASES:
        torch.manual_seed(seed)
        return tf.AutoModelForCausalLM.from_config(CASES[model_type].config()).float().train()
    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if "ConditionalGeneration" in cls_name:
        return Skip("multimodal: its causal-LM class is a conditional-generation model")
    reason = not_plainly_trainable(model_type)
    if reason:
        return Skip(reason)
    try:
        config, meta = _tiny_on_meta(model_type)
    except Exception as exc:
        return Skip(f"model does not build: {type(exc).__name__}: {str(exc)[:120]}")
    try:
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


def not_plainly_trainable(model_type: str) -> str:
    """Why ``model_type`` cannot be trained from ``input_ids`` alone, read from its default
    config ("" when nothing says so)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = getattr(cls, "__dataclass_fields__", {})
    if "backbone_hidden_size" in fields and "text_config" in fields:
        # a drafter: every layer attends to keys and values the target model computed
        return ("a speculative-decoding drafter: its layers reuse the keys and values of a target "
                "model (backbone_hidden_size); it does not run from input_ids alone")
    try:
        default = cls()
    except Exception:  # the defaults do not validate: the rules may still make a valid one
        return ""
    if getattr(default, "is_encoder_decoder", False) and not hasattr(default, "is_decoder"):
        return "encoder-decoder: its causal-LM class needs encoder outputs"
    return ""


def make_ids(batch: int, seq: int, seed: int = 1, model_type: str = "") -> torch.Tensor:
    low, high = (CASES[model_type].tokens if model_type in CASES else (TOKEN_LOW, TOKEN_HIGH))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (batch, seq), generator=g)


# ---------------------------------------------------------------- cases an issue reported
@dataclass(frozen=True)
class Case:
    """A model the sweep trains besides the config classes' shrunk defaults: one an issue
    reported, with the issue's own config (built with seed 0 by ``build_tiny``), token ids
    (``make_ids`` draws them from ``tokens``, seed 1) and packing (arch_sweep.chunk_size:
    the largest parameter or a sixth of all elements, whichever is larger)."""

    config: Callable[[], Any]
    tokens: tuple[int, int]


def _granitemoehybrid_issue39():
    """Issue 39: two Mamba layers, each with four experts (two per token) and a shared MLP."""
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        attention_dropout=0.0, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=32, layer_types=["linear_attention", "linear_attention"],
        mamba_n_heads=4, mamba_d_state=16, mamba_d_head=32, mamba_chunk_size=16)
    config.use_cache = False
    config.output_router_logits = False
    config._attn_implementation = "eager"
    return config


CASES = {"granitemoehybrid_issue39": Case(_granitemoehybrid_issue39, tokens=(1, 128))}


def causal_lm_types() -> list[str]:
    """Every model type with a causal-LM class in the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
