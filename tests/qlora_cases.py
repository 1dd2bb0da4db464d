"""QLoRA as users run it, the same on both sides of a comparison.

A tiny Llama is saved to a folder once and loaded from it quantised on load by
bitsandbytes (nf4, the packed codes stored in ``STORAGE``), then prepared with PEFT's
``prepare_model_for_kbit_training`` (input gradients, gradient checkpointing, non-quantised
weights in float32) and given LoRA adapters on every projection. The reference trains it in
one plain process on the whole batch; hf_elixir trains it over real ranks.

The 4-bit layers compute in float32 (``bnb_4bit_compute_dtype``): a bf16 product would
round each row of a matmul to 8 bits, and splitting the batch over ranks changes the
blocking of the product; the comparison is then about the runtime, not about bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loops import elixir_steps, plain_steps

BATCH, SEQ, STEPS, LR = 4, 16, 10, 1e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(folder: Path) -> Path:
    """A tiny Llama with tied embeddings (the packed projections are most of its bytes, as
    in a real base), saved in float32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def load_4bit(folder: Path, storage: str = "bfloat16", checkpointing: bool = True):
    """The base quantised on load and prepared for k-bit training, as a QLoRA script does."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_quant_storage=getattr(torch, storage))
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=torch.float32)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)


def build(folder: Path, storage: str = "bfloat16", checkpointing: bool = True):
    """The QLoRA model: the 4-bit base with LoRA r=8 adapters (B not zero, so the adapters
    change the output from the first step)."""
    from peft import LoraConfig, get_peft_model

    model = load_4bit(folder, storage, checkpointing)
    torch.manual_seed(1)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0,
                        init_lora_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def batch() -> torch.Tensor:
    return torch.randint(1, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def packed_bytes(model) -> int:
    from hf_elixir.profile.params import is_packed

    return sum(p.numel() * p.element_size() for p in model.parameters() if is_packed(p))


def adapters(model_or_state) -> dict[str, torch.Tensor]:
    state = model_or_state if isinstance(model_or_state, dict) else model_or_state.state_dict()
    return {k: v.detach().float().clone() for k, v in state.items() if "lora_" in k}


def reference(folder: Path, storage: str = "bfloat16") -> dict[str, Any]:
    model = build(folder, storage)
    losses = plain_steps(model, optimizer(model), [batch()] * STEPS, clip=1.0)
    return {"losses": losses, "state": adapters(model)}


def elixir(rank: int, world_size: int, folder: Path, storage: str, plan_kwargs: dict) -> dict[str, Any]:
    """One rank: the QLoRA model trained through ElixirModule on its slice of the batch."""
    import hf_elixir as hfe

    model = build(folder, storage)
    packed = packed_bytes(model)
    opt = optimizer(model)
    plan = hfe.ElixirPlan.simple(model, world_size, **plan_kwargs)
    emodel = hfe.ElixirModule(model, plan)
    eopt = hfe.ElixirOptimizer(emodel, opt)
    per = BATCH // world_size
    ids = batch()[rank * per : (rank + 1) * per]
    losses = elixir_steps(emodel, eopt, [ids] * STEPS, clip=1.0)
    state = emodel.state_dict()
    packed_chunks = [c for c in emodel.chunks if c.packed]
    out = {
        "losses": losses,
        "state": adapters(state),
        "memory": emodel.memory_report(),
        "packed_bytes": packed,
        "packed_shard_bytes": sum(c.shard_size * c.dtype.itemsize for c in packed_chunks),
        "packed_chunks": len(packed_chunks),
        "base_after": {k: v for k, v in state.items() if k.endswith("base_layer.weight")} if rank == 0 else None,
        "checkpointing": model.is_gradient_checkpointing,
        "repack_off": all(not getattr(m, "support_avx512bf16_for_cpu", False) for m in model.modules()),
    }
    emodel.close()
    return out
