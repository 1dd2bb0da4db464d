"""A 4-bit (QLoRA) base on the meta device, for planning, and what its quantisation costs.

``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` turns
every linear layer but the output head into a bitsandbytes ``Linear4bit`` whose weight is
packed (two 4-bit codes a byte, in ``bnb_4bit_quant_storage``) and whose quantisation state
holds one scale per block of 64 weights (fp32, or with double quantisation one byte each
plus one fp32 scale per 256 of them). ``meta_4bit`` builds the same structure on the meta
device, with no weights, so the profile sees what the runtime will chunk: the packed bytes
(``params.chunk_numel``), the state every rank keeps whole (``quant_state_bytes``), and
bitsandbytes' own forward and backward (each dequantises the weight into a temporary).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_elixir.profile.params import is_packed
from hf_elixir.vocab import DTYPES, canonical_dtype

BLOCKSIZE = 64          # bitsandbytes' 4-bit block (weights per scale)
NESTED_BLOCKSIZE = 256  # double quantisation: scales per second-level scale


def quant_state_bytes(p: torch.Tensor) -> int:
    """Bytes of a packed weight's quantisation state (0 for any other tensor): the block
    scales, the code book and, with double quantisation, the second level. Every rank
    keeps it whole, beside the gathered weight."""
    state = getattr(p, "quant_state", None) if is_packed(p) else None
    if state is None:
        return 0
    total = 0
    for owner in (state, getattr(state, "state2", None)):
        if owner is None:
            continue
        for name in ("absmax", "code", "offset"):
            t = getattr(owner, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def packed_weights(p: torch.Tensor) -> int:
    """How many weights a packed 4-bit parameter holds (its quantisation state's shape, or
    two a byte); 0 for any other tensor."""
    if not is_packed(p):
        return 0
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else 2 * p.numel() * p.element_size()


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def meta_4bit(model: nn.Module, storage: str = "bfloat16", compute_dtype: str = "bfloat16",
              double_quant: bool = False, quant_type: str = "nf4") -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of a meta-device ``model`` but its output head
    with a bitsandbytes ``Linear4bit`` whose weight is packed in ``storage`` and whose
    quantisation state has the sizes a real load would give. Returns ``model``.

    Raises:
        ImportError: bitsandbytes is not installed.
    """
    try:
        import bitsandbytes as bnb
        from bitsandbytes.functional import QuantState, get_4bit_type
    except ImportError as e:
        raise ImportError("planning a 4-bit base needs bitsandbytes: pip install 'hf_elixir[qlora]'") from e
    store = DTYPES[canonical_dtype(storage, ValueError)] if storage != "uint8" else torch.uint8
    compute = DTYPES[canonical_dtype(compute_dtype, ValueError)]
    head = _output_head(model)
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and mod is not head and not is_packed(mod.weight)]
    for name, mod in targets:
        out_f, in_f = mod.weight.shape
        n = out_f * in_f
        with torch.device("meta"):
            layer = bnb.nn.Linear4bit(in_f, out_f, bias=mod.bias is not None, compute_dtype=compute,
                                      quant_type=quant_type, quant_storage=store, device="meta")
            blocks = -(-n // BLOCKSIZE)
            code = get_4bit_type(quant_type, device="meta")
            if double_quant:
                second = QuantState(absmax=torch.empty(-(-blocks // NESTED_BLOCKSIZE), dtype=torch.float32),
                                    code=torch.empty(256, dtype=torch.float32), blocksize=NESTED_BLOCKSIZE,
                                    dtype=torch.float32)
                state = QuantState(absmax=torch.empty(blocks, dtype=torch.uint8), shape=torch.Size((out_f, in_f)),
                                   code=code, blocksize=BLOCKSIZE, quant_type=quant_type, dtype=compute,
                                   offset=torch.empty((), dtype=torch.float32), state2=second)
            else:
                state = QuantState(absmax=torch.empty(blocks, dtype=torch.float32), shape=torch.Size((out_f, in_f)),
                                   code=code, blocksize=BLOCKSIZE, quant_type=quant_type, dtype=compute)
            packed = torch.empty(-(-n // (2 * store.itemsize)), 1, dtype=store)
        layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=BLOCKSIZE,
                                         quant_type=quant_type, quant_storage=store, module=layer,
                                         bnb_quantized=True)
        layer.quant_state = state
        if mod.bias is not None:
            layer.bias = nn.Parameter(torch.empty_like(mod.bias, dtype=compute), requires_grad=False)
        layer.weight.requires_grad_(False)
        layer.requires_grad_(False)
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, layer)
    return model


__all__ = ["meta_4bit", "packed_weights", "quant_state_bytes"]
