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


# ---------------------------------------------------------------- what composes (acceptance 3)
def _lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


#: case -> (compute dtype, the plan's activation checkpointing, LoRA, loss tolerance, graphs).
#: Under LoRA the first block's input needs no gradient (the embedding is frozen) and the
#: second's does: two guard sets, so two graphs, as any compile of these blocks makes.
CASES = {
    "bf16_checkpointing": ("bfloat16", True, False, 2e-3, 1),
    "fp16_loss_scaling": ("float16", False, False, 2e-3, 1),
    "lora_fp32": ("float32", False, True, 1e-5, 2),
}


def _one_rank_run(case: str, compile: bool, steps: int = 3) -> dict:
    """World size 1, every chunk offloaded (so the module hooks gather and release): losses,
    trainable weights and dynamo's counts, the counters cleared first."""
    from torch._dynamo.utils import counters

    dtype, checkpointing, lora, _, _ = CASES[case]
    torch._dynamo.reset()
    counters.clear()
    model = make_model("llama")
    if lora:
        model = _lora(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, eps=1e-6, fused=True)
    plan = hfe.ElixirPlan.simple(model, 1, chunk_size=1 << 14, compute_dtype=dtype, offload_params=True,
                                 offload_fraction=1.0, activation_checkpointing=checkpointing)
    emodel = hfe.ElixirModule(model, plan, compile=compile or None)
    eopt = hfe.ElixirOptimizer(emodel, opt)
    ids = make_batch(4, 16)
    losses = []
    for _ in range(steps):
        loss = emodel(input_ids=ids, labels=ids).loss
        eopt.backward(loss)
        eopt.step()
        eopt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "counts": dynamo_counts(), "compiled": emodel.compiled.active,
            "state": {k: v.float() for k, v in emodel.trainable_state_dict().items()}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_blocks_compose(case: str) -> None:
    """bf16 with the model's own checkpointing (which the plan turns on), fp16 with the
    optimizer's loss scaling, LoRA adapters over a frozen base: the compiled run compiles the
    decoder block once (a graph really captured: under checkpointing dynamo once gave the
    block up without a word) and trains as the eager run of the same plan does, which the
    equivalence suite holds to plain PyTorch."""
    tolerance, graphs = CASES[case][3:]
    compiled = _one_rank_run(case, compile=True)
    eager = _one_rank_run(case, compile=False)
    assert compiled["compiled"] and compiled["counts"] == {"frames_ok": graphs, "unique_graphs": graphs,
                                                           "recompiles": 0}
    assert eager["counts"]["frames_ok"] == 0
    for a, b in zip(eager["losses"], compiled["losses"]):
        assert abs(a - b) <= tolerance * abs(a), (eager["losses"], compiled["losses"])
    assert set(compiled["state"]) == set(eager["state"]) and compiled["state"]
    for key, want in eager["state"].items():
        assert (compiled["state"][key] - want).norm() <= 20 * tolerance * want.norm() + 1e-6, key


class BreakingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        torch._dynamo.graph_break()
        return torch.relu(x)


class Breaking(nn.Module):
    """Two repeated blocks whose forward has a graph break in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks = nn.Embedding(96, 16), nn.ModuleList([BreakingBlock(), BreakingBlock()])

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return x


def test_a_graph_break_inside_a_block_is_said() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Breaking()
    emodel = hfe.ElixirModule(model, _plan(model), compile="eager")
    assert emodel.compiled.active
    with pytest.warns(CompileWarning, match="broke the graph of block 'blocks.0'"):
        emodel(input_ids=torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileWarning)  # said once, not every call
        emodel(input_ids=torch.zeros(1, 4, dtype=torch.long)).sum().backward()


def _replan_run(compile) -> dict:
    """Two steps, a re-plan to an rCache of one block (as a recovery may choose), two more."""
    import dataclasses

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_model("llama")
    plan = hfe.ElixirPlan.simple(model, 1, chunk_size=1 << 13, offload_params=True, offload_fraction=1.0)
    emodel = hfe.ElixirModule(model, plan, compile=compile)
    eopt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, fused=True))
    ids, losses, counts = make_batch(4, 16), [], []
    for step in range(4):
        if step == 2:
            emodel.adopt_plan(dataclasses.replace(emodel.plan, rcache_blocks=1))
        loss = emodel(input_ids=ids, labels=ids).loss
        eopt.backward(loss)
        eopt.step()
        eopt.zero_grad()
        losses.append(loss.item())
        counts.append(dynamo_counts())
    return {"losses": losses, "counts": counts, "rcache": emodel.plan.rcache_blocks, "need": emodel.compiled.need}


def test_a_replan_keeps_the_compiled_blocks_valid_and_their_chunks_cached() -> None:
    """A re-plan (out-of-memory recovery's adopt_plan) leaves no stale graph: the compiled
    code depends on shapes only and serves on, with no compile after the first step; an
    rCache too small for a block's chunks is kept at what the block needs, with a warning,
    rather than failing the block's fetch."""
    eager = _replan_run(None)
    with pytest.warns(CompileWarning, match=r"rCache of 1 block\(s\) cannot hold a compiled block's \d+ chunks"):
        compiled = _replan_run("aot_eager")
    assert eager["rcache"] == 1 and compiled["need"] > 1 and compiled["rcache"] == compiled["need"]
    assert compiled["counts"][0]["frames_ok"] == 1 and all(c == compiled["counts"][0] for c in compiled["counts"])
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)


def _resumed_run(compile, folder, steps: int = 4, stop_at: int | None = None) -> dict:
    """``steps`` steps; with ``stop_at``, a checkpoint there and a fresh compiled module and
    optimizer that load it and go on (the new module compiles nothing new)."""
    from hf_elixir import checkpoint

    def build_run():
        model = make_model("llama")
        plan = hfe.ElixirPlan.simple(model, 1, chunk_size=1 << 14, offload_params=True, offload_fraction=1.0)
        emodel = hfe.ElixirModule(model, plan, compile=compile)
        return emodel, hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6,
                                                                       fused=True))

    torch._dynamo.reset()
    emodel, eopt = build_run()
    ids, losses = make_batch(4, 16), []
    for step in range(steps):
        if step == stop_at:
            checkpoint.save(emodel, eopt, folder)
            emodel.close()
            emodel, eopt = build_run()
            checkpoint.load(emodel, eopt, folder)
        loss = emodel(input_ids=ids, labels=ids).loss
        eopt.backward(loss)
        eopt.step()
        eopt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "counts": dynamo_counts(), "state": emodel.trainable_state_dict()}


def test_a_compiled_run_resumes_from_its_checkpoint(tmp_path) -> None:
    """Checkpoint and resume: the loaded module's released chunks are gathered by the block
    hooks as before, and the resumed run reuses the block's compiled code (one frame in all:
    the new module's blocks share the code object) and equals the uninterrupted run."""
    from torch._dynamo.utils import counters

    counters.clear()
    straight = _resumed_run("aot_eager", tmp_path / "unused")
    counters.clear()
    resumed = _resumed_run("aot_eager", tmp_path / "ckpt", stop_at=2)
    assert resumed["counts"]["frames_ok"] == 1 and resumed["counts"]["recompiles"] == 0
    assert resumed["losses"] == pytest.approx(straight["losses"], rel=1e-6)
    for key, want in straight["state"].items():
        assert torch.equal(resumed["state"][key], want), key


def _disk_run(compile, nvme: str, steps: int = 3) -> dict:
    """Every chunk's parameters and optimizer state off the device, half the trainable
    chunks' state on the disk tier."""
    torch._dynamo.reset()
    model = make_model("llama")
    plan = hfe.ElixirPlan.simple(model, 1, chunk_size=1 << 13, offload_params=True, offload_fraction=1.0)
    for chunk in [c for c in plan.chunks if not c.frozen][::2]:
        chunk.optim_placement = "disk"
    emodel = hfe.ElixirModule(model, plan, compile=compile, nvme_path=nvme)
    eopt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, fused=True))
    ids, losses = make_batch(4, 16), []
    for _ in range(steps):
        loss = emodel(input_ids=ids, labels=ids).loss
        eopt.backward(loss)
        eopt.step()
        eopt.zero_grad()
        losses.append(loss.item())
    state = emodel.trainable_state_dict()
    emodel.close()
    return {"losses": losses, "counts": dynamo_counts(), "state": state,
            "disk_chunks": sum(c.optim_placement == "disk" for c in plan.chunks)}


def test_compiled_blocks_over_the_disk_tier(tmp_path) -> None:
    """The disk tier holds optimizer state only; the compiled blocks see gathered weights as
    ever: one frame, and the weights of the eager run bit for bit."""
    from torch._dynamo.utils import counters

    eager = _disk_run(None, str(tmp_path))
    counters.clear()
    compiled = _disk_run("aot_eager", str(tmp_path))
    assert compiled["disk_chunks"] >= 2 and compiled["counts"]["frames_ok"] == 1
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-6)
    for key, want in eager["state"].items():
        assert torch.equal(compiled["state"][key], want), key
