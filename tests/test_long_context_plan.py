"""Long context, planned (issue 61, part 3 and acceptance 3): per-block activation policies,
logits in pieces, the MLP in tiles, pinned host memory for activations in the host budget,
the policies in ``hf-elixir plan``'s table and ``--seq-len max``."""

from __future__ import annotations

import json
from dataclasses import replace
import time

import pytest
import torch

from hf_elixir.cli import main
from hf_elixir.planner import activations
from hf_elixir.planner.activations import Levers
from hf_elixir.planner.longest import Probe, longest_sequence
from hf_elixir.planner.record import BLOCK_POLICIES, ElixirPlan
from hf_elixir.planner.search import plan
from hf_elixir.profile import profile_model
from hf_elixir.profile.blocks import block_figures

QLORA_ON_A_4090 = ["--load-in-4bit", "--lora-r", "16", "--hardware", "rtx4090", "--gpus", "1",
                   "--batch-size", "1", "--dtype", "bf16"]


def _tiny_llama(layers: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_profile():
    return profile_model(_tiny_llama(), (1, 1024), dtype="float32", attention_target="cuda")


def _model(profile, h2d: float = 25e9) -> activations.ActivationModel:
    n_ck, n_pl = len(profile.checkpointed.trace.events), len(profile.plain.trace.events)
    model = activations.model_of(profile, [1e-3] * n_ck, [1e-3] * n_pl, h2d, h2d, 1e-5)
    assert model is not None
    return model


def _walked_peak(profile, offloaded: bool) -> int:
    """The checkpointed trace walked event by event, without the activation model: the bytes
    alive at each event's top, less (when ``offloaded``) the held inputs of every block that
    is neither running nor next, which then wait in host memory."""
    path = profile.extra["block_path"]
    ck = block_figures(profile.checkpointed.trace, path)
    held = [b.held for b in ck.blocks]
    trace = profile.checkpointed.trace
    n = len(held)
    top = 0
    where = -1  # the block running now (n: the head)
    for e, ((phase, module), (_, most)) in enumerate(zip(trace.events, trace.live)):
        name = module[len(path) + 1:].split(".", 1)[0] if module.startswith(path + ".") else None
        if name is not None:
            where = int(name)
        elif phase == "forward" and where >= 0:
            where = n  # the head
        elif phase != "forward" and where == 0:
            where = -1  # after every block's backward: nothing is held
        away = sum(held[: max(0, min(where, n) - 1)]) if offloaded and where >= 0 else 0
        top = max(top, most - away)
    return top


def test_block_figures_reproduce_the_traced_peaks(tiny_profile):
    """Every block recomputed (no pieces, no tiles) is the checkpointed trace's own peak, and
    every block kept the plain trace's: the model's figures are the trace's, cut at blocks."""
    model = _model(tiny_profile)
    n = model.n
    assert n == 4 and tiny_profile.extra["block_path"] == "model.layers"
    assert model.peak(Levers(("recompute",) * n)) == tiny_profile.checkpointed.memory.peak
    assert model.peak(Levers(("keep",) * n)) == tiny_profile.plain.memory.peak
    # a recomputed block holds one hidden state (its output), float32: 1024 x 64 x 4 bytes
    assert model.hidden_bytes == 1024 * 64 * 4


def test_offloaded_inputs_peak_is_the_trace_less_what_waits_on_the_host(tiny_profile):
    """Every block's input offloaded: the model's peak equals the checkpointed trace walked
    event by event with every input but the running block's and the next one's taken off the
    device (two blocks' inputs in flight, not all of them)."""
    model = _model(tiny_profile)
    n = model.n
    assert _walked_peak(tiny_profile, offloaded=False) == tiny_profile.checkpointed.memory.peak
    offloaded = model.peak(Levers(("recompute_offload",) * n))
    # beside the walk: the copies of the shared inputs (rotary tables, position ids) in the
    # two groups a backward holds, which the trace never saw
    walked = _walked_peak(tiny_profile, offloaded=True)
    assert model.shared_inputs > 0
    assert walked <= offloaded <= walked + 2 * model.shared_inputs
    assert offloaded < model.peak(Levers(("recompute",) * n))


def test_logit_pieces_keep_one_piece_of_the_head(tiny_profile):
    """Logits in pieces: the head's rise (the whole logits' cost in the trace) gives way to
    what runtime/logit_pieces.py allocates: one piece's logits and an fp32 tensor of their
    shape (fp32 here), the head's input and its gradient whole, and, the head training, its
    weight's fp32 gradient sum and the gradient handed on. The step pays the head's forward
    once more (the logits recomputed piece by piece)."""
    model = _model(tiny_profile)
    pol = ("recompute",) * model.n
    whole, pieces = model.head_peak(pol, 0), model.head_peak(pol, 256)
    vocab = tiny_profile.extra["vocab_size"]
    head = [p for p in tiny_profile.params if p.shape[0] == vocab][-1]
    assert tiny_profile.dtype == "float32" and not head.frozen
    held = 256 * vocab * (4 + 4) + 2 * model.hidden_bytes + head.numel * (4 + 4)
    assert whole - pieces == pytest.approx(model.ckpt.head_rise - held)
    assert pieces < whole
    frozen = replace(model, head_grad_numel=0)
    assert model.head_peak(pol, 256) - frozen.head_peak(pol, 256) == 8 * head.numel
    assert model.time_change(Levers(pol, 256))[0] > 0


def test_offload_is_priced_against_the_host_link_and_the_compute_it_hides_behind(tiny_profile):
    """An offloaded input's copies cost only what the neighbouring block's compute does not
    hide: nothing on a fast link, the copy time less the compute on a slow one. Its pinned
    host bytes are the inputs it moves."""
    levers = Levers(("recompute_offload",) * 4)
    fast = _model(tiny_profile, h2d=1e15).time_change(levers)
    slow = _model(tiny_profile, h2d=1e6).time_change(levers)
    model = _model(tiny_profile)
    held = [b.held + model.shared_inputs for b in model.ckpt.blocks]
    assert fast[1] == 0 and fast[2] == sum(held)
    copies = 2 * sum(held) / 1e6  # out and back, at 1 MB/s
    compute = 1e-3 * (len(tiny_profile.checkpointed.trace.events))  # every event 1 ms in _model
    assert copies - compute <= slow[1] <= copies


@pytest.fixture(scope="module")
def tight_gpu():
    """A tiny Llama at 8,192 tokens for one RTX 4090 and a budget that its checkpointed step
    does not fit (its activations cut by 40%): (config, profile, budget)."""
    cfg = _tiny_llama(layers=8)
    prof = profile_model(cfg, (1, 8192), dtype="bf16", attention_target="cuda")
    roomy = plan(cfg, (1, 8192), hardware="rtx4090", world_size=1, dtype="bf16", efficiency="calibrated",
                 profile=prof)
    mem = roomy.predictions["memory"]
    state = sum(v for k, v in mem.items() if k not in ("activations", "margin"))
    frac = roomy.predictions["margin"]["allocator_fraction"]
    context = roomy.predictions["margin"]["context_bytes"]
    budget = int((state + 0.6 * prof.checkpointed.memory.peak) * (1 + frac) + context)
    return cfg, prof, budget


def _tight_plan(tight_gpu, **kw) -> ElixirPlan:
    cfg, prof, budget = tight_gpu
    return plan(cfg, (1, 8192), hardware="rtx4090", world_size=1, dtype="bf16", memory_budget=budget,
                efficiency="calibrated", profile=prof, **kw)


def test_search_writes_policies_and_pieces_into_a_gpu_plan_that_needs_them(tight_gpu):
    """A budget that neither the plain nor the checkpointed step fits: the plan offloads
    inputs or splits the logits, names each block's policy, and counts the pinned
    activations in the host memory it prints."""
    p = _tight_plan(tight_gpu)
    assert p.predictions["peak_bytes"] <= tight_gpu[2]
    assert p.block_policies or p.logit_piece_tokens
    assert set(p.block_policies.values()) <= set(BLOCK_POLICIES)
    if p.block_policies:
        assert list(p.block_policies) == [f"model.layers.{i}" for i in range(8)]
    lc = p.predictions["long_context"]
    assert lc["pinned_activation_bytes"] <= p.predictions["host_bytes_per_rank"]
    assert ElixirPlan.from_json(p.to_json()).block_policies == p.block_policies


def test_pinned_activations_count_against_host_memory(tight_gpu):
    """The pinned inputs are host memory like offloaded state: the plan counts them in its
    host bytes, and given a host too small for them it offloads no more than fits there
    (here: none, fitting the device with smaller logit pieces and MLP tiles instead)."""
    roomy = _tight_plan(tight_gpu)
    pinned = roomy.predictions["long_context"]["pinned_activation_bytes"]
    assert pinned > 0, "the plan was expected to offload activations"
    assert roomy.predictions["host_bytes_per_rank"] >= pinned
    usable = pinned // 4
    tight = _tight_plan(tight_gpu, host_memory=int(usable / 0.9))
    assert tight.predictions["peak_bytes"] <= tight_gpu[2]
    assert tight.predictions["long_context"]["pinned_activation_bytes"] <= usable
    assert tight.predictions["host_bytes_per_rank"] <= usable + 1


def test_longest_sequence_brackets_within_one_granule():
    """The search over lengths ends with the longest fitting multiple of the granule next to
    the shortest that does not, in a few probes, on a peak that is not a straight line."""
    limit = 77_000
    calls = []

    def probe(s: int) -> Probe:
        calls.append(s)
        peak = 1e6 + 300.0 * s + 0.001 * s * s
        fits = s <= limit
        return Probe(s, fits, peak)

    budget = 1e6 + 300.0 * limit + 0.001 * limit * limit
    found = longest_sequence(probe, budget)
    assert found.best.seq_len == 76_800 and found.beyond.seq_len == 76_800 + 1024
    assert len(calls) <= 8


@pytest.mark.parametrize("shape,seq_len", [
    ({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
      "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 131072,
      "rope_theta": 500000.0}, 98_304),
    ({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
      "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}, 65_536),
], ids=["llama-3.1-8b", "llama-2-7b"])
def test_qlora_fits_long_context_on_one_rtx4090(shape, seq_len, tmp_path, capsys):
    """Acceptance 3: QLoRA r16 on one 24 GiB card, batch 1, bf16: Llama-3.1-8B's shape at
    98,304 tokens, Llama-2-7B's at 65,536. The plan offloads block inputs and runs the logits
    in pieces, and its table shows each run of blocks' policy."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": False, **shape}))
    out = tmp_path / "plan.json"
    started, cpu = time.perf_counter(), time.process_time()
    rc = main(["plan", str(cfg), *QLORA_ON_A_4090, "--seq-len", str(seq_len), "--json", str(out)])
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    text = capsys.readouterr().out
    assert rc == 0, text
    p = ElixirPlan.from_json(out)
    assert p.predictions["seq_len"] == seq_len
    assert p.predictions["peak_bytes"] <= p.predictions["budget_bytes"] == 24 * 2**30
    assert "recompute_offload" in p.block_policies.values() and p.logit_piece_tokens > 0
    assert "rec+off" in text and f"pieces of {p.logit_piece_tokens}" in text
    print(f"\n{shape['vocab_size']}-vocab plan at {seq_len}: {wall:.1f} s wall, {cpu:.1f} s CPU in this process")


def test_plan_seq_len_max_reports_the_longest_that_fits(tmp_path, capsys):
    """``--seq-len max``: the printed length fits and one granule more does not, each checked
    by a plan of its own."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "intermediate_size": 512,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 32000, "tie_word_embeddings": False}))
    args = ["plan", str(cfg), "--hardware", "rtx4090", "--gpus", "1", "--gpu-memory", "1GiB", "--batch-size", "1",
            "--dtype", "bf16"]
    assert main([*args, "--seq-len", "max"]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.startswith("longest sequence that fits"))
    longest = int(line.split(":")[1].split()[0])
    assert longest % 1024 == 0 and longest >= 8192
    assert main([*args, "--seq-len", str(longest)]) == 0
    assert main([*args, "--seq-len", str(longest + 1024)]) == 1
    capsys.readouterr()


def test_seq_len_rejects_words_other_than_max(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt2", "--seq-len", "longest"])
    assert e.value.code == 2
    assert "'max'" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["flash", "memory-efficient"])
def test_gpu_attention_flops_halve_for_a_causal_mask(dtype):
    """The GPU's fused attention kernels (flash in bf16, memory-efficient in fp32), forward
    and backward: a causal mask skips about half the blocks, as the CPU kernel's count
    already says, so a long-context step's compute (which hides the activation copies) is
    not priced at twice its attention."""
    from hf_elixir.profile.memory import LiveStorageTracker, SDPAKernelMode

    def flops(causal: bool) -> int:
        q = torch.empty(1, 4, 1024, 64, device="meta", dtype=dtype, requires_grad=True)
        tracker = LiveStorageTracker()
        with SDPAKernelMode("cuda"), tracker:
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=causal)
            out.sum().backward()
        return tracker.flops

    full = flops(False)
    assert full >= 4 * 4 * 1024 * 1024 * 64 * 3  # forward and a backward of at least twice it
    assert flops(True) * 2 == full
