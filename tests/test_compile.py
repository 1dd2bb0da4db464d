"""torch.compile under the chunk runtime (issue 64): compiled blocks, hooks outside.

- A world-size-2 run whose chunks are gathered, released and offloaded every step, with
  ``ElixirModule(compile=True)``, matches plain PyTorch (eager, one process, whole batch)
  and compiles the decoder block once: one frame, one graph, nothing after the first step.
- Every way of asking reaches the runtime (the ``elixir:`` option, Accelerate's dynamo
  plugin); where compile cannot apply, one warning says why and the model runs eager; a
  request torch cannot honour is an error before the model is touched.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hf_elixir as hfe
from equivalence import (ACCUM, GLOBAL_BATCH, SEQ, STEPS, assert_matches, build, make_optimizer,
                         rank_micro_batches, reference_run)
from harness import run_distributed
from hf_elixir.integrations.compiling import WHOLE_MODEL_NOTE, compile_request
from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin
from hf_elixir.runtime.compiled import CompileError, CompileOptions, CompileWarning, repeated_blocks
from loops import elixir_steps
from tiny_models import make_batch, make_model


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"frames_ok": counters["frames"]["ok"], "unique_graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values())}


def compiled_rank(rank: int, world_size: int, arch: str, plan_kwargs: dict) -> dict:
    """One rank of a compiled run: losses, final state, dynamo's counts before each step."""
    torch.manual_seed(0)
    model = build(arch)
    opt, sched = make_optimizer(model)
    plan = hfe.ElixirPlan.simple(model, world_size, **plan_kwargs)
    emodel = hfe.ElixirModule(model, plan, compile=True)
    eopt = hfe.ElixirOptimizer(emodel, opt)
    rows = rank_micro_batches(make_batch(GLOBAL_BATCH, SEQ), rank, world_size)
    before: list[dict] = []
    losses = elixir_steps(emodel, eopt, rows * STEPS, clip=1.0, scheduler=sched, accumulate=ACCUM,
                          each_step=lambda step: before.append(dynamo_counts()))
    state = emodel.state_dict()
    return {"losses": losses, "state": state if rank == 0 else None, "before": before, "after": dynamo_counts(),
            "compiled": emodel.compiled.describe(), "cache_blocks": plan.rcache_blocks, "chunks": plan.n_chunks}


def test_offloaded_compiled_run_matches_plain_and_never_recompiles() -> None:
    """Acceptance 2: every chunk offloaded (parameters and optimizer state on the host) and
    gathered into rCache blocks that are released and regathered every step; the block's
    code is compiled once and reused by both blocks and every later step."""
    plan = dict(chunk_size=12288, offload_fraction=1.0, offload_params=True, rcache_blocks=2)
    ref = reference_run("gpt2")
    results = run_distributed(compiled_rank, 2, "gpt2", plan, timeout=600)
    got = results[0]
    assert got["chunks"] > got["cache_blocks"]  # chunks are evicted and gathered again every step
    assert "compile: 2 block(s) (GPT2Block)" in got["compiled"]
    for r in results:
        assert r["before"][0] == {"frames_ok": 0, "unique_graphs": 0, "recompiles": 0}
        # one distinct block shape: one frame, one graph, for both blocks and every step
        assert r["after"] == {"frames_ok": 1, "unique_graphs": 1, "recompiles": 0}
        assert all(counts == r["after"] for counts in r["before"][1:])
    assert_matches(ref, got, label="compiled, offloaded")


# ---------------------------------------------------------------- asking, and being told no
def _plan(model: nn.Module, **kwargs) -> hfe.ElixirPlan:
    return hfe.ElixirPlan.simple(model, 1, **kwargs)


def _released(model: nn.Module) -> bool:
    return any(type(p) is not nn.Parameter for p in model.parameters())


def test_a_backend_torch_lacks_is_an_error_before_the_model_changes() -> None:
    model = make_model("gpt2")
    with pytest.raises(CompileError, match="not one torch has"):
        hfe.ElixirModule(model, _plan(model), compile="no_such_backend")
    assert not _released(model) and not hasattr(model, "_hf_elixir_wrapped")
    with pytest.raises(CompileError, match="mode 'fast'"):
        CompileOptions(mode="fast")
    with pytest.raises(CompileError, match="unknown compile option"):
        CompileOptions.parse({"backend": "inductor", "fullgrpah": True})


class NoBlocks(nn.Module):
    """An embedding and a head: nothing repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(96, 16), nn.Linear(16, 96)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def test_a_model_without_repeated_blocks_says_so_and_runs_eager() -> None:
    torch.manual_seed(0)
    model = NoBlocks()
    with pytest.warns(CompileWarning, match="NoBlocks has no repeated blocks.*runs eager"):
        emodel = hfe.ElixirModule(model, _plan(model), compile=True)
    assert not emodel.compiled.active and "running eager" in emodel.compiled.describe()
    assert "forward" not in model.head.__dict__
    emodel(input_ids=torch.zeros(1, 4, dtype=torch.long)).sum().backward()  # and it runs


def test_a_block_the_rcache_cannot_hold_says_so_and_runs_eager() -> None:
    model = make_model("llama")
    plan = _plan(model, chunk_size=1024, rcache_blocks=2)
    with pytest.warns(CompileWarning, match=r"reads \d+ chunks.*rCache holds 2; plan with rcache_blocks"):
        emodel = hfe.ElixirModule(model, plan, compile=True)
    assert not emodel.compiled.active
    assert all("forward" not in block.__dict__ for _, block in repeated_blocks(model))


def test_cuda_graph_modes_are_replaced_with_a_warning() -> None:
    model = make_model("gpt2")
    with pytest.warns(CompileWarning, match="CUDA graphs.*'max-autotune-no-cudagraphs'"):
        emodel = hfe.ElixirModule(model, _plan(model), compile={"mode": "max-autotune"})
    assert emodel.compiled.active and emodel.compiled.options.mode == "max-autotune-no-cudagraphs"
    # the blocks are fetched whole and their forwards are compiled; their submodules have no hooks
    names = emodel.compiled.unit_names
    assert names == ["transformer.h.0", "transformer.h.1"]
    blocks = dict(model.named_modules())
    assert all("forward" in blocks[n].__dict__ for n in names)
    assert all(not m._forward_pre_hooks for n in names for m in blocks[n].modules() if m is not blocks[n])


def test_the_elixir_option_reads_and_checks_compile(monkeypatch) -> None:
    assert ElixirPlugin().compile == "off"
    assert ElixirPlugin(compile=True).compile == "inductor"
    assert ElixirPlugin(compile="aot_eager").compile == "aot_eager"
    monkeypatch.setenv("ELIXIR_COMPILE", "true")
    assert ElixirPlugin().compile == "inductor" and ElixirPlugin().to_env()["ELIXIR_COMPILE"] == "inductor"
    with pytest.raises(ElixirConfigError, match="elixir option compile: compile backend 'indcutor'"):
        ElixirPlugin(compile="indcutor")


def test_accelerates_dynamo_plugin_reaches_the_runtime() -> None:
    from accelerate.utils import TorchDynamoPlugin

    whole = TorchDynamoPlugin(backend="inductor", mode="max-autotune-no-cudagraphs", fullgraph=True)
    options, note = compile_request(whole, "off")
    assert (options.backend, options.mode, options.fullgraph) == ("inductor", "max-autotune-no-cudagraphs", True)
    assert note == WHOLE_MODEL_NOTE
    regional = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True)
    assert compile_request(regional, "off") == (CompileOptions("aot_eager"), None)
    assert compile_request(TorchDynamoPlugin(backend="no"), "eager") == (CompileOptions("eager"), None)
    assert compile_request(TorchDynamoPlugin(backend="no"), "off") == (None, None)
