"""Packed 4-bit weights (QLoRA's base) in chunks: what the runtime must know about them.

A bitsandbytes 4-bit layer keeps its weight as packed codes (``Params4bit``: two 4-bit
codes a byte, in the storage dtype the model was loaded with) and its quantisation state
(block scales, the code book, the unpacked shape) on the parameter. Chunks hold the packed
bytes like any frozen weight (``Slot.view``: moved byte for byte, never cast); the
quantisation state is small and stays whole on every rank, on the compute device, where
the layer's kernel reads it beside the gathered weight. Nothing here imports bitsandbytes:
layers and weights are recognised by their attributes.

One thing in bitsandbytes works against sharing a weight's storage: on a CPU with AVX512
bf16, a 4-bit layer that runs in evaluation mode without gradients re-packs its weight *in
place* into another layout (``weight.data`` replaced, the quantisation state flagged). A
gathered weight is a view into a chunk's block; the re-packed copy would be lost at the
next release while the flag stays, and the next forward would read the chunk's bytes in
the wrong layout. So under hf_elixir those layers keep the one layout (their training
path, which computes the same product), and a model that was already re-packed is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_elixir.profile.params import is_packed
from hf_elixir.vocab import HfElixirError

_CPU_REPACK_SWITCH = "support_avx512bf16_for_cpu"  # Linear4bit: re-pack on CPU inference


def prepare_packed_layers(model: nn.Module, device: torch.device) -> int:
    """Make every module whose weight is packed safe to shard (see the module docstring)
    and put its quantisation state on ``device``. Returns how many there are. Raises
    before anything is changed when a weight was already re-packed for CPU inference."""
    layers = [(name, mod) for name, mod in model.named_modules()
              if isinstance(getattr(mod, "weight", None), torch.Tensor) and is_packed(mod.weight)]
    for name, mod in layers:
        if getattr(mod.weight.quant_state, "packing_format_for_cpu", False):
            raise HfElixirError(
                f"hf_elixir: the 4-bit weight of {name!r} was re-packed by bitsandbytes for CPU "
                "inference (the model ran in eval mode without gradients before it was wrapped), "
                "and that layout cannot be sharded; load the model again and wrap it before "
                "running it, or call model.train() and run nothing before wrapping"
            )
    for _, mod in layers:
        if hasattr(mod, _CPU_REPACK_SWITCH):
            setattr(mod, _CPU_REPACK_SWITCH, False)
        state = mod.weight.quant_state
        if state is not None and hasattr(state, "to"):
            state.to(device)
    return len(layers)
