"""A rank of tests/test_host_memory.py: train a small GPT-2 for many steps, record RSS."""

from __future__ import annotations

import warnings

import torch


def train_and_watch_rss(rank: int, world_size: int, steps: int, growth: float | None) -> dict:
    from transformers import AutoModelForCausalLM, GPT2Config

    import hf_elixir as hfe
    from hf_elixir.runtime.host_memory import HeapGuard, resident_bytes

    torch.manual_seed(0)
    # a wide vocabulary: the logits and the embedding's gradient are tens of MB per step
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=32000, n_positions=128,
                     bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg)
    plan = hfe.ElixirPlan.simple(model, world_size=world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        em = hfe.ElixirModule(model, plan)
    if growth is not None:
        em.heap_guard = HeapGuard(growth=growth)
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(rank)
    rss = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (2, 128), generator=gen)
        opt.backward(em(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        rss.append(resident_bytes())
    em.drain()
    return {"rss": rss, "trims": em.heap_guard.trims, "baseline": em.heap_guard.baseline,
            "warnings": [str(w.message) for w in caught]}
