"""The planner's replay of the runtime's fetching (``hf_elixir.planner.fetches``) against the
runtime itself: in real two-rank gloo training, every fetch of a steady-state step gathers
on demand, waits for and prefetches exactly the chunks the replay says, in the same order,
and the optimizer step starts the same gathers for the next step. The cost model times
its gathers from this replay and the traffic prediction counts them from it."""

from __future__ import annotations

import torch

import hf_elixir as hfe
from equivalence import GLOBAL_BATCH, SEQ, make_optimizer
from harness import run_distributed
from hf_elixir.planner import fetches
from hf_elixir.profile.needs import trace_fetch_needs
from hf_elixir.runtime import fetch as fetch_mod
from hf_elixir.runtime import module as module_mod
from hf_elixir.runtime.chunk import Chunk
from loops import elixir_steps
from tiny_models import make_batch, make_model

BATCH = (GLOBAL_BATCH // 2, SEQ)


def _build(arch: str) -> torch.nn.Module:
    """A tiny model; ``lora_<arch>``: with LoRA adapters over its frozen base, so frozen
    chunks (kept gathered across the optimizer step) take part in the fetching."""
    if not arch.startswith("lora_"):
        return make_model(arch)
    from peft import LoraConfig, get_peft_model

    model = make_model(arch[len("lora_"):])
    return get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn", "c_fc"], lora_dropout=0.0))


def _plans(model, world_size: int) -> list[tuple[str, hfe.ElixirPlan]]:
    """Plans that exercise re-gathers, refused prefetches and recomputation."""
    def simple(**kw):
        return hfe.ElixirPlan.simple(model, world_size, example_batch=BATCH, chunk_size=4096, **kw)

    n = simple().n_chunks
    least = simple().min_rcache_blocks
    out = []
    for R in sorted({least, least + 1, n}):
        for depth in (0, 1, 2):
            if R >= least:
                out.append((f"R={R} depth={depth}", simple(rcache_blocks=R, prefetch_depth=depth)))
    ckpt_least = simple(activation_checkpointing=True).min_rcache_blocks
    out.append(("checkpointing", simple(activation_checkpointing=True, rcache_blocks=ckpt_least, prefetch_depth=2)))
    return out


class _Log:
    """The runtime's gathers, grouped by the fetch (or optimizer step) that started them."""

    def __init__(self) -> None:
        self.entries: list[dict] = []

    def open(self, kind: str) -> None:
        self.entries.append({"kind": kind, "demand": [], "waits": [], "ahead": []})


def _record(rank: int, world_size: int, arch: str) -> list:
    log = _Log()
    originals = (fetch_mod.Fetcher.fetch, fetch_mod.Fetcher._gather, Chunk.finish_gather,
                 module_mod.ElixirModule.prefetch_next_pass, fetch_mod.Fetcher.release_all)

    def fetch(self, cids):
        log.open("fetch")
        return originals[0](self, cids)

    def gather(self, chunk, async_op):
        log.entries[-1]["ahead" if async_op else "demand"].append(chunk.index)
        return originals[1](self, chunk, async_op)

    def finish(self):
        entry = log.entries[-1] if log.entries else None
        if entry and entry["kind"] == "fetch" and self.index not in entry["demand"]:
            entry["waits"].append(self.index)  # a gather started earlier (not its own)
        return originals[2](self)

    def next_pass(self):
        log.open("carried")
        return originals[3](self)

    def release(self, *args, **kwargs):
        log.open("release")
        return originals[4](self, *args, **kwargs)

    fetch_mod.Fetcher.fetch, fetch_mod.Fetcher._gather, Chunk.finish_gather = fetch, gather, finish
    module_mod.ElixirModule.prefetch_next_pass, fetch_mod.Fetcher.release_all = next_pass, release
    results = []
    try:
        model0 = _build(arch)
        for name, plan in _plans(model0, world_size):
            model = _build(arch)
            em = hfe.ElixirModule(model, plan)
            opt, _ = make_optimizer(model)
            eopt = hfe.ElixirOptimizer(em, opt)
            ids = make_batch(GLOBAL_BATCH, SEQ)[rank * BATCH[0]:(rank + 1) * BATCH[0]]
            steps: list[list[dict]] = []

            def new_step(_: int) -> None:  # each step's gathers in a list of their own
                log.entries = []
                steps.append(log.entries)

            elixir_steps(em, eopt, [ids] * 4, each_step=new_step)
            em.close()
            results.append((name, plan.to_dict(), steps))
    finally:
        (fetch_mod.Fetcher.fetch, fetch_mod.Fetcher._gather, Chunk.finish_gather,
         module_mod.ElixirModule.prefetch_next_pass, fetch_mod.Fetcher.release_all) = originals
    return results


def _replayed(model, plan: hfe.ElixirPlan) -> fetches.FetchReplay:
    needs = trace_fetch_needs(model, BATCH, plan.fetch_units, plan.activation_checkpointing)
    chunk_of = {name: i for i, c in enumerate(plan.chunks) for name in c.params}
    requests = fetches.fetch_ops(needs.pins, needs.module_params, chunk_of, plan.n_chunks)
    return fetches.replay(requests, plan.rcache_blocks, plan.prefetch_depth, plan.world_size,
                          frozen=frozenset(plan.frozen_chunks))


def _check(arch: str) -> None:
    ranks = run_distributed(_record, 2, arch, timeout=600)
    model = _build(arch)
    regathers = 0
    for name, plan_dict, steps in ranks[0]:
        plan = hfe.ElixirPlan.from_dict(plan_dict)
        want = _replayed(model, plan)
        # the steady state: step 3's fetches, and the gathers step 2's optimizer step started
        carried = [e["ahead"] for e in steps[1] if e["kind"] == "carried"]
        got = [(tuple(e["demand"]), tuple(e["waits"]), tuple(e["ahead"])) for e in steps[2] if e["kind"] == "fetch"]
        assert tuple(carried[0] if carried else ()) == want.carried, name
        assert got == [(f.demand, f.waits, f.ahead) for f in want.fetches], name
        counted = [0] * plan.n_chunks
        for e in steps[2]:
            for c in e["demand"] + e["ahead"]:
                counted[c] += 1
        assert counted == want.gathers, name
        regathers += sum(want.gathers) - (plan.n_chunks - len(plan.frozen_chunks))
        assert steps[2] == steps[3], f"{name}: the runtime had not reached its steady state"
    assert ranks[0] == ranks[1]  # every rank fetches alike (the collectives line up)
    assert regathers > 0  # the small rCaches re-gathered


def test_the_replay_matches_the_runtime_gpt2():
    _check("gpt2")


def test_the_replay_matches_the_runtime_llama():
    _check("llama")


def test_the_replay_matches_the_runtime_with_frozen_chunks():
    """LoRA over a frozen GPT-2: a frozen chunk still gathered when the optimizer steps stays
    gathered, so the next pass finds it without a gather; one the rCache dropped is gathered
    again like any chunk."""
    _check("lora_gpt2")
