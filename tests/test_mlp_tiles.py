"""Each block's MLP over sequence tiles (issue 61, ``ElixirPlan.mlp_tiles``, runtime/mlp_tiles.py).

A tiny Llama (hidden 16, intermediate 48, two layers) at 256 tokens trains through the real
runtime with ``mlp_tiles=4``; the reference is plain PyTorch on an untouched copy (no
hf_elixir). Loss and gradients must equal it (fp32: within 1e-6 relative), at one rank and
over two gloo ranks whose rCache is as small as the model allows. A dispatch-mode tracker
records the largest tensor of the intermediate's shape, (batch, tokens, intermediate), that
any operation makes, in forward and backward: tiled, it must be one tile's (a quarter of the
sequence); the reference makes the whole one. The search's plan for the Llama-3.1-8B shape at
98,304 tokens on a 24 GiB card carries its tile count in the plan field, and the summary
prints it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hf_elixir as hfe
from harness import run_distributed
from hf_elixir.cli import main
from hf_elixir.planner.record import ElixirPlan
from loops import gathered_gradients

SEQ, INTER, VOCAB, TILES = 256, 48, 128, 4
FP32_TOL = 1e-6


class LargestIntermediate(TorchDispatchMode):
    """The most elements of any tensor an operation returns whose shape is (batch, tokens,
    ``inter``): the MLP's intermediate and its gradient (not the (hidden, inter) weights,
    which have two dimensions). ``backward``: the same, for operations run in a backward."""

    def __init__(self, inter: int) -> None:
        super().__init__()
        self.inter, self.largest, self.backward = inter, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == self.inter:
                self.largest = max(self.largest, t.numel())
                if torch._C._current_graph_task_id() != -1:
                    self.backward = max(self.backward, t.numel())
        return out


def llama() -> torch.nn.Module:
    config = tf.LlamaConfig(hidden_size=16, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=SEQ, vocab_size=VOCAB,
                            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.config.use_cache = False
    return model.train()


def tokens(batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(3))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_equal_grads(got: dict, want: dict, exact: bool = True) -> None:
    """Every gradient within 1e-6 relative of the reference's; and (``exact``) bit for bit, but for the
    MLPs' weights: theirs is summed over the tiles, in another order than one product over
    the whole sequence adds it (about 2e-7 relative here). The gradients the MLPs pass back
    to their inputs are each token's own, so everything below them is exact."""
    assert set(got) == set(want)
    worst = max((rel(got[n], want[n]), n) for n in want)
    assert worst[0] <= FP32_TOL, f"{worst[1]}: gradient off by {worst[0]:.2e} relative"
    inexact = sorted(n for n in want if not torch.equal(got[n], want[n]))
    assert not exact or all(".mlp." in n for n in inexact), inexact


def reference(batch: torch.Tensor) -> dict:
    """Plain PyTorch, whole MLPs: loss, gradients and the largest intermediate seen."""
    model = llama()
    with LargestIntermediate(INTER) as seen:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "largest": seen.largest, "backward": seen.backward}


def tiled_plan(model, world_size: int = 1, checkpointing: bool = True, **kw) -> ElixirPlan:
    plan = ElixirPlan.simple(model, world_size, activation_checkpointing=checkpointing, **kw)
    return dataclasses.replace(plan, mlp_tiles=TILES)


@pytest.mark.parametrize("checkpointing", [True, False], ids=["blocks-recomputed", "blocks-kept"])
def test_one_rank_equals_the_whole_mlp_with_one_tile_alive(checkpointing) -> None:
    ids = tokens()
    want = reference(ids)
    model = llama()
    emodel = hfe.ElixirModule(model, tiled_plan(model, checkpointing=checkpointing))
    assert list(emodel.mlp_tiles.tiled) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    with LargestIntermediate(INTER) as seen:
        out = emodel(input_ids=ids, labels=ids)
        out.loss.backward()
    tile = SEQ // TILES * INTER
    assert want["largest"] == want["backward"] == SEQ * INTER  # the tracker sees the whole one untiled
    assert 0 < seen.backward <= seen.largest <= tile
    assert out.loss.item() == want["loss"]  # each token's MLP output is the whole MLP's, bit for bit
    grads = {s.name: c.grad_shard[s.offset:s.offset + s.numel].view(s.shape).clone()
             for c in emodel.chunks for s in c.slots}
    assert_equal_grads(grads, want["grads"])


@pytest.mark.parametrize("first,largest", [("recompute_offload", SEQ // TILES * INTER), ("offload", SEQ * INTER)])
def test_block_policies_with_tiles(first, largest) -> None:
    """The first block's input offloaded (the 8B plan's policy): its MLP is tiled too. The
    first block offloaded without recompute: its MLP runs whole (what it saves goes to the
    host), the other block's in tiles. Loss and gradients are the whole MLP's either way."""
    ids = tokens()
    want = reference(ids)
    model = llama()
    plan = dataclasses.replace(tiled_plan(model), block_policies={"model.layers.0": first,
                                                                 "model.layers.1": "recompute"})
    emodel = hfe.ElixirModule(model, plan)
    with LargestIntermediate(INTER) as seen:
        out = emodel(input_ids=ids, labels=ids)
        out.loss.backward()
    assert seen.largest == largest
    assert out.loss.item() == want["loss"]
    grads = {s.name: c.grad_shard[s.offset:s.offset + s.numel].view(s.shape).clone()
             for c in emodel.chunks for s in c.slots}
    assert_equal_grads(grads, want["grads"])


def test_compiled_blocks_run_their_mlp_in_tiles() -> None:
    """Each decoder layer compiled (aot_eager: the real operators, which the tracker sees),
    the hooks outside: the tiles and their checkpoints trace into the block's graph, and the
    loss and gradients are still the whole MLP's."""
    ids = tokens()
    want = reference(ids)
    torch._dynamo.reset()
    try:
        model = llama()
        emodel = hfe.ElixirModule(model, tiled_plan(model), compile="aot_eager")
        with LargestIntermediate(INTER) as seen:
            out = emodel(input_ids=ids, labels=ids)
            out.loss.backward()
    finally:
        torch._dynamo.reset()
    assert emodel.compiled.unit_names == ["model.layers.0", "model.layers.1"]
    assert 0 < seen.backward <= seen.largest <= SEQ // TILES * INTER
    assert abs(out.loss.item() - want["loss"]) <= FP32_TOL * want["loss"]
    grads = {s.name: c.grad_shard[s.offset:s.offset + s.numel].view(s.shape).clone()
             for c in emodel.chunks for s in c.slots}
    assert_equal_grads(grads, want["grads"], exact=False)


def test_untiled_plan_leaves_the_mlp_whole() -> None:
    """mlp_tiles=1 wires nothing: the MLP's intermediate is whole, as the model makes it."""
    model = llama()
    emodel = hfe.ElixirModule(model, ElixirPlan.simple(model, activation_checkpointing=True))
    assert not emodel.mlp_tiles.tiled and "forward" not in model.model.layers[0].mlp.__dict__
    ids = tokens()
    with LargestIntermediate(INTER) as seen:
        emodel(input_ids=ids, labels=ids).loss.backward()
    assert seen.backward == SEQ * INTER


def _two_ranks(rank: int, world_size: int) -> dict:
    """One rank of a 2-rank run with as few rCache blocks as the model allows (chunks are
    evicted and gathered again within the step, so each tile's recompute fetches them)."""
    import torch.distributed as dist

    model = llama()
    least = ElixirPlan.simple(model, world_size, chunk_size=1024, activation_checkpointing=True).min_rcache_blocks
    plan = tiled_plan(model, world_size, chunk_size=1024, rcache_blocks=least)
    emodel = hfe.ElixirModule(model, plan)
    ids = tokens(batch=2)[rank:rank + 1]
    with LargestIntermediate(INTER) as seen:
        out = emodel(input_ids=ids, labels=ids)
        out.loss.backward()
    losses = [torch.zeros(()) for _ in range(world_size)]
    dist.all_gather(losses, out.loss.detach())
    grads = gathered_gradients(emodel, model)["grads"]
    return {"losses": [x.item() for x in losses], "grads": grads if rank == 0 else None,
            "spare": plan.n_chunks - plan.rcache_blocks, "largest": seen.largest, "tiled": len(emodel.mlp_tiles.tiled)}


def test_two_ranks_over_gloo_equal_the_whole_computation() -> None:
    results = run_distributed(_two_ranks, 2)
    got = results[0]
    assert got["spare"] > 0 and got["tiled"] == 2
    assert all(r["largest"] <= SEQ // TILES * INTER for r in results)
    model = llama()
    ids = tokens(batch=2)
    losses = []
    for r in range(2):
        loss = model(input_ids=ids[r:r + 1], labels=ids[r:r + 1]).loss
        (loss / 2).backward()
        losses.append(loss.item())
    assert got["losses"] == losses
    # averaged over the ranks, where the reference adds halves: not bit for bit, tiles or not
    assert_equal_grads(got["grads"], {n: p.grad for n, p in model.named_parameters()}, exact=False)


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "4"])
def test_a_bad_tile_count_is_refused_before_anything_changes(bad) -> None:
    model = llama()
    plan = dataclasses.replace(ElixirPlan.simple(model), mlp_tiles=bad)
    with pytest.raises(hfe.PlanError, match="mlp_tiles must be an int >= 1"):
        hfe.ElixirModule(model, plan)
    assert not hasattr(model, "_hf_elixir_wrapped") and "forward" not in model.model.layers[0].mlp.__dict__


class TwoArgumentMLP(torch.nn.Module):
    """An MLP whose forward takes more than the hidden states (as routed ones do)."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.inner = mlp

    def forward(self, hidden, router_scale=None):
        return self.inner(hidden)


def test_an_mlp_that_takes_more_than_the_hidden_states_is_refused() -> None:
    model = llama()
    model.model.layers[1].mlp = TwoArgumentMLP(model.model.layers[1].mlp)
    plan = tiled_plan(model)
    with pytest.raises(hfe.PlanError, match=r"model\.layers\.1\.mlp .*cannot be tiled.*mlp_tiles=1"):
        hfe.ElixirModule(model, plan)
    assert not hasattr(model, "_hf_elixir_wrapped") and "forward" not in model.model.layers[0].mlp.__dict__


def test_a_model_without_decoder_blocks_runs_whole_and_says_so() -> None:
    """Layers that are not Transformers' checkpointable blocks: no MLP is found, one warning
    says so, and the model trains as it is."""
    model = llama()
    for layer in model.model.layers:
        layer.__class__ = type("PlainLayer", (torch.nn.Module,), {"forward": type(layer).forward, "gradient_checkpointing": False})
    with pytest.warns(UserWarning, match="no MLP to tile"):
        emodel = hfe.ElixirModule(model, tiled_plan(model, checkpointing=False))
    assert not emodel.mlp_tiles.tiled and "run whole" in emodel.mlp_tiles.note
    ids = tokens()
    with LargestIntermediate(INTER) as seen:
        emodel(input_ids=ids, labels=ids).loss.backward()
    assert seen.backward == SEQ * INTER


def test_the_searched_8b_plan_at_98k_tokens_carries_the_tiles(tmp_path, capsys) -> None:
    """The Llama-3.1-8B shape, QLoRA r16, one RTX 4090, batch 1, bf16, 98,304 tokens (issue
    61's acceptance 3): the plan the search makes tiles the MLP, in the plan's field, and its
    summary says so."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "llama", "tie_word_embeddings": False, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0}))
    out = tmp_path / "plan.json"
    rc = main(["plan", str(cfg), "--load-in-4bit", "--lora-r", "16", "--hardware", "rtx4090", "--gpus", "1",
               "--batch-size", "1", "--dtype", "bf16", "--seq-len", "98304", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    p = ElixirPlan.from_json(out)
    assert p.mlp_tiles > 1 and p.mlp_tiles == p.predictions["long_context"]["mlp_tiles"]
    assert f"MLP over {p.mlp_tiles} sequence tiles" in p.summary() and f"MLP x{p.mlp_tiles}" in text


def test_the_search_offers_no_tiles_where_an_mlp_routes_tokens() -> None:
    """A routed MLP (a fetch unit: mixture-of-experts) is one the runtime refuses to tile, so
    the search does not offer tiles for it; the same blocks without routing are offered them."""
    from hf_elixir.planner import activations
    from hf_elixir.profile import profile_model

    config = tf.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                            tie_word_embeddings=False)
    profile = profile_model(config, (1, 1024), dtype="float32", attention_target="cuda")

    def offered(p) -> set[int]:
        n_ck, n_pl = len(p.checkpointed.trace.events), len(p.plain.trace.events)
        model = activations.model_of(p, [1e-3] * n_ck, [1e-3] * n_pl, 25e9, 25e9, 1e-5)
        return {o.levers.mlp_tiles for o in model.options(recomputing=True, offload=True)}

    assert max(offered(profile)) > 1
    routed = dataclasses.replace(profile, fetch_units=[f"model.layers.{i}.mlp" for i in range(4)])
    assert offered(routed) == {1}
