"""Partly frozen fine-tunes, the same on both sides of a comparison.

Each case builds a tiny model from tests/tiny_models.py and freezes part of it the way a
user would: PEFT LoRA adapters over a frozen base, BitFit (only biases train), frozen
embeddings under trainable blocks, every other block frozen. The reference trains it in one
plain PyTorch process on the whole batch; hf_elixir trains it over real ranks.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from loops import elixir_steps, plain_steps
from tiny_models import make_batch, make_model

BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-2


def _lora(arch: str, targets: list[str]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = make_model(arch)
        # non-zero B: the adapters change the output from the first step on
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                            init_lora_weights=False)
        return get_peft_model(model, config)

    return build


def _bitfit() -> nn.Module:
    model = make_model("gpt2")
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(".bias"))
    return model


def _frozen_embeddings() -> nn.Module:
    model = make_model("gpt2")  # wte is tied to lm_head: the head is frozen with it
    model.transformer.wte.weight.requires_grad_(False)
    model.transformer.wpe.weight.requires_grad_(False)
    return model


def _every_other_block() -> nn.Module:
    model = make_model("llama")
    for i, layer in enumerate(model.model.layers):
        if i % 2 == 0:
            layer.requires_grad_(False)
    return model


CASES: dict[str, Callable[[], nn.Module]] = {
    "lora_gpt2": _lora("gpt2", ["c_attn"]),
    "lora_llama": _lora("llama", ["q_proj", "v_proj", "gate_proj", "down_proj"]),
    "bitfit": _bitfit,
    "frozen_embeddings": _frozen_embeddings,
    "every_other_block": _every_other_block,
}


def build_case(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[name]()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # every parameter, frozen ones included, as many scripts build it: torch skips those
    # without gradients, and so must hf_elixir
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-6)


def reference(name: str) -> dict:
    model = build_case(name)
    opt = make_optimizer(model)
    losses = plain_steps(model, opt, [make_batch(BATCH, SEQ)] * STEPS, clip=1.0)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def frozen_state(name: str) -> dict[str, torch.Tensor]:
    """The frozen tensors of a freshly built case, by state_dict key."""
    model = build_case(name)
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items() if id(v) in frozen}


def elixir(rank: int, world_size: int, name: str, plan_kwargs: dict) -> dict:
    """One rank: the case trained through ElixirModule/ElixirOptimizer on its slice of the
    batch; losses averaged over ranks, the full state, the memory report and the plan."""
    import hf_elixir as hfe

    model = build_case(name)
    opt = make_optimizer(model)
    kwargs = dict(plan_kwargs)
    at_minimum = kwargs.get("rcache_blocks") == "min"
    if at_minimum:
        kwargs.pop("rcache_blocks")
    plan = hfe.ElixirPlan.simple(model, world_size, **kwargs)
    if at_minimum:  # every chunk is released and gathered again in forward and backward
        plan = hfe.ElixirPlan.simple(model, world_size, rcache_blocks=plan.min_rcache_blocks, **kwargs)
        assert plan.rcache_blocks < plan.n_chunks
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    emodel = hfe.ElixirModule(model, plan)
    eopt = hfe.ElixirOptimizer(emodel, opt)
    ids = make_batch(BATCH, SEQ)
    per = BATCH // world_size
    losses = elixir_steps(emodel, eopt, [ids[rank * per : (rank + 1) * per]] * STEPS, clip=1.0)
    state = emodel.state_dict()
    padding = sum((emodel.chunks[i].size - sum(s.numel for s in emodel.chunks[i].slots))
                  * emodel.dtype.itemsize for i in plan.frozen_chunks)
    return {"losses": losses, "state": state if rank == 0 else None, "memory": emodel.memory_report(),
            "frozen_bytes": frozen_bytes, "frozen_padding": padding, "plan": plan.to_dict(),
            "optimizer_state_lengths": [len(s) for s in eopt.flat_state],
            "grad_shard_sizes": [c.grad_shard.numel() for c in emodel.chunks]}
