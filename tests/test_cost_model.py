"""The cost model's pieces against independent references (issue 9).

Timings are never asserted here (benchmarks/bench_planner.py compares predicted and measured
times on a quiet machine); what is checked is that the model prices what really runs: every
operator the profiler saw, chunks as large as the runtime lays them out, the persistent
memory the runtime's ledger holds, and activations and gradient buffers at one instant.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import hf_elixir as hfe
from hf_elixir.measure.calibrate import ComputeFigures, price
from hf_elixir.planner import cost, fetches, packing, search
from hf_elixir.profile import profile_model
from hf_elixir.profile.trace import EventWork


def tiny_gpt2():
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def gpt2():
    """A model only planned (never wrapped: ElixirModule empties a model's own parameters)."""
    model = tiny_gpt2()
    return model, profile_model(model, (2, 32), dtype="float32", attention_target="cpu")


def test_event_work_covers_every_operator_of_the_step(gpt2):
    """Each fetch event carries the operators up to the next one; together they are the
    whole step: the same FLOPs as the profiler's total, recomputation included."""
    _, prof = gpt2
    for step in (prof.plain, prof.checkpointed):
        tr = step.trace
        assert len(tr.work) == len(tr.events) == len(tr.live)
        assert sum(w.flops for w in tr.work) == step.memory.flops
        assert sum(w.bytes for w in tr.work) > 0 and all(w.ops >= 0 for w in tr.work)
        assert max(top for _, top in tr.live) <= step.memory.peak
    assert sum(w.flops for w in prof.checkpointed.trace.work) > sum(w.flops for w in prof.plain.trace.work)


def test_layout_sizes_are_the_runtimes_chunk_sizes(gpt2):
    """The planner sizes chunks as ElixirModule lays them out (alignment, no padding to
    chunk_size), so its memory and byte predictions use the sizes that are allocated."""
    model, prof = gpt2
    sizes = {p.name: p.numel for p in prof.params}
    for W in (1, 2, 3):
        p = hfe.ElixirPlan.simple(model, world_size=W, chunk_size=20000, example_batch=(2, 32))
        chunks = [c.params for c in p.chunks]
        if W == 1:
            em = hfe.ElixirModule(tiny_gpt2(), p)
            assert [c.size for c in em.chunks] == packing.layout_sizes(chunks, sizes, 1, 4)
        # the runtime lays chunks out with plan.chunk_layout; an independent statement of
        # its rule: 16-byte aligned offsets, the total rounded to W alignments
        expected = []
        for names in chunks:
            end = 0
            for n in names:
                end = -(-end // 4) * 4 + sizes[n]
            expected.append(-(-end // (4 * W)) * (4 * W))
        assert packing.layout_sizes(chunks, sizes, W, 4) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_predicted_persistent_memory_equals_the_ledger(gpt2, dtype):
    """Parameter shards, master weights, optimizer state and gradient shards as predicted
    equal what the runtime's ledger holds after a step, category by category (one rank, half
    the optimizer state offloaded). In fp32 the master is the shard: no master bytes."""
    model, prof = gpt2
    if dtype != "float32":
        prof = profile_model(model, (2, 32), dtype=dtype, attention_target="cpu")
    hw = hfe.HardwareProfile.preset("cpu")
    cands, packings = search.enumerate_candidates(prof, hw, 1, dtype, "adamw")
    c = next(c for c in cands if c.n_chunks >= 2 and c.n_optim_cpu == c.n_chunks // 2 and c.n_param_cpu == 0)
    plan = search.materialize(c, packings[c.chunk_size], prof, hw, 1, dtype, "adamw", c.peak)
    model = tiny_gpt2()
    em = hfe.ElixirModule(model, plan)
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 128, (2, 32))
    opt.backward(em(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()
    held = em.memory_report()["current"]
    mem = plan.predictions["memory"]
    assert held["param_shards"] == mem["parameters"]
    assert held["master_weights"] == mem["master_weights"]
    assert (held["master_weights"] > 0) == (dtype != "float32")
    assert held["optimizer_state"] == mem["optimizer_state"] > 0
    assert held["grad_shards"] == mem["gradients"] - _buffers_at_peak(plan)
    assert held["rcache"] == mem["rcache"] == 0  # one rank: every device shard is its own block


def _buffers_at_peak(plan) -> int:
    mem = plan.predictions["memory"]
    dev_elems = sum(ch.numel for ch in plan.chunks if ch.optim_placement == "device")
    return mem["gradients"] - dev_elems * 4


def test_aligned_peak_adds_what_coexists():
    """Activations peaking at the loss and gradient buffers peaking later are not added at
    their separate maxima."""
    live = [(0, 100), (100, 900), (800, 500), (500, 300)]
    buffers = [0.0, 0.0, 200.0, 700.0]
    assert cost.aligned_peak(live, buffers) == (300.0, 700.0)  # not 900 + 700
    assert cost.aligned_peak(live, [0.0, 0.0, 500.0, 0.0]) == (500.0, 500.0)


def test_pricing_follows_the_measured_figures():
    """Matmuls are priced at the rate of their own size (log-log between measured points,
    clamped outside), other operators by bytes and calls, all scaled by the efficiency."""
    figs = ComputeFigures(matmul_curve={"float32": [[1e6, 1e10], [1e8, 1e11]]}, read_bandwidth=1e9,
                          write_curve=[[1e3, 1e8], [1e7, 1e9]], op_overhead=1e-5, efficiency=2.0)
    assert figs.matmul_rate("float32", 1e5) == 1e10
    assert figs.matmul_rate("float32", 1e9) == 1e11
    assert figs.matmul_rate("float32", 1e7) == pytest.approx(10 ** 10.5)
    assert figs.write_rate(1e5) == pytest.approx(10 ** 8.5)
    w = EventWork()
    w.add(2**20, 0, [2**12], "NT")  # a matmul of 2**20 FLOPs writing a new 4 KiB output
    w.add(0, 10**6, [])        # one in-place element-wise operator reading 1 MB
    expected = (2**20 / figs.matmul_rate("float32", 2**20.5) + 2**12 / figs.write_rate(2**12.5)
                + 1e6 / 1e9 + 2 * 1e-5)
    assert price(w, figs, "float32") == pytest.approx(2.0 * expected)


def test_efficiency_follows_the_width_of_the_model_planned(gpt2):
    """The block efficiency is calibrated per width; a plan uses the one at its model's width
    (read from the weights: GPT-2's n_embd, Llama's hidden_size), interpolated log-log."""
    from transformers import LlamaConfig

    figs = ComputeFigures(efficiency=1.1, efficiency_curve=[[128.0, 1.4], [512.0, 1.0]])
    assert figs.efficiency_at(None) == 1.1
    assert figs.efficiency_at(64) == 1.4 and figs.efficiency_at(4096) == 1.0
    assert figs.efficiency_at(256) == pytest.approx(1.4 ** 0.5)
    assert figs.for_width(128).efficiency == 1.4 and figs.efficiency == 1.1
    assert ComputeFigures(efficiency=0.9).efficiency_at(128) == 0.9  # figures from before the curve
    assert gpt2[1].hidden_size == 64
    llama = LlamaConfig(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=200)
    assert profile_model(llama, (1, 16), checkpointing=False).hidden_size == 96


def test_the_post_backward_sequence_is_priced_at_its_measured_rate():
    """Where calibration measured the whole post-backward sequence (clipping, AdamW,
    zeroing, on every rank at once), it prices it; three small all-reduces bracket it with
    several ranks. Figures from before that measurement price it pass by pass."""
    hw = replace(hfe.HardwareProfile.preset("cpu"), collective_latency=0.002)
    measured = ComputeFigures(update_rate=5e8, adam_rate=2e9, read_bandwidth=1e10)
    assert cost.after_backward(1e8, measured, hw, 1) == pytest.approx(0.2)
    assert cost.after_backward(1e8, measured, hw, 2) == pytest.approx(0.2 + 3 * 0.002)
    older = replace(measured, update_rate=0.0)
    assert cost.after_backward(1e8, older, hw, 1) == pytest.approx(3 * 4e8 / 1e10 + 1e8 / 2e9)


def _ops(events: list[tuple[str, str]], chunk_of_module: dict[str, int]):
    """Fetch requests of a trace whose modules each pin one chunk around their event."""
    pins = [x for _, m in events for x in (("pin", m), ("unpin", m))]
    params = {m: [m] for m in chunk_of_module}
    return fetches.fetch_ops(pins, params, dict(chunk_of_module), len(set(chunk_of_module.values())), events)


def test_communication_hides_behind_compute_by_the_measured_share():
    """A GPU runs collectives beside compute; CPU ranks that fill every core hide only the
    share calibration measured (``HardwareProfile.comm_overlap``), idle cores the rest. The
    simulated step grows linearly with the share that does not hide."""
    import os

    figs = ComputeFigures(threads=1)
    hw = hfe.HardwareProfile.preset("cpu").with_cluster(gpus_per_node=2)
    idle = max(0.0, 1.0 - 2 / (os.cpu_count() or 1))
    links = cost.Links.of(hw, 2, figs)
    assert links.gather_overlap == links.reduce_overlap == idle  # a preset measured nothing
    hw.comm_overlap = {"gather": 0.6, "reduce": 0.2}
    measured = cost.Links.of(hw, 2, figs)
    assert measured.gather_overlap == pytest.approx(idle + (1 - idle) * 0.6)
    assert measured.reduce_overlap == pytest.approx(idle + (1 - idle) * 0.2)
    gpu = cost.Links.of(hfe.HardwareProfile.preset("a100-80g").with_cluster(gpus_per_node=2), 2, figs)
    assert gpu.gather_overlap == gpu.reduce_overlap == 1.0

    events = [("forward", "a"), ("forward", "b"), ("backward", "b"), ("backward", "a")]
    seq = [cost.Access(ph, m, ({"a": 0, "b": 1}[m],), s) for (ph, m), s in zip(events, (1.0, 1.0, 2.0, 2.0))]
    ahead = fetches.replay(_ops(events, {"a": 0, "b": 1}), 2, 1, 2)  # b's gather starts at a's fetch
    assert ahead.fetches[0].ahead == (1,) and ahead.fetches[1].waits == (1,)

    def end(g: float, r: float) -> float:
        return cost.simulate(seq, ahead, [1e9, 1e9], 2, replace(gpu, gather_overlap=g, reduce_overlap=r)).backward_end

    serial = cost.simulate(seq, ahead, [1e9, 1e9], 2, replace(gpu, gather_overlap=0.0, reduce_overlap=0.0))
    assert serial.backward_end == pytest.approx(serial.compute + serial.comm_busy)
    assert end(1.0, 1.0) < end(0.0, 1.0) < serial.backward_end
    assert end(1.0, 1.0) < end(1.0, 0.0) < serial.backward_end
    assert end(0.5, 0.5) == pytest.approx((end(0.0, 0.0) + end(1.0, 1.0)) / 2)


def _work(c) -> tuple:
    """What a candidate makes the runtime do on a CPU device, offloading aside."""
    return (c.chunk_size, c.checkpointing, min(c.rcache_blocks, c.n_chunks), c.prefetch_depth)


def test_offloading_on_a_cpu_device_costs_no_time(gpt2):
    """On a CPU device "offloaded" state already lies in host memory: the runtime copies
    nothing (its counter sees no host<->device bytes, as traffic.step_traffic predicts) and
    updates every shard on the same cores, so an offloading candidate is predicted exactly
    as fast as its twin that offloads nothing, and moves no bytes over PCIe; on a GPU the
    copies move bytes and change the step's time (a host optimizer running beside the
    device can also shorten it)."""
    model, prof = gpt2
    for W in (1, 2):
        cands, packings = search.enumerate_candidates(prof, hfe.HardwareProfile.preset("cpu"), W, "float32", "adamw")
        twins: dict = {}
        for c in cands:
            twins.setdefault(_work(c), set()).add(round(c.step_time, 12))
            assert c.pcie_bytes == 0 and c.time["pcie"] == 0
        assert any(c.n_optim_cpu and c.n_param_cpu for c in cands)
        assert all(len(times) == 1 for times in twins.values()), twins
    gpu = search.enumerate_candidates(prof, hfe.HardwareProfile.preset("a100-80g"), 1, "float32", "adamw")[0]
    plain = {_work(c): c.step_time for c in gpu if not c.n_optim_cpu}
    offloading = [c for c in gpu if c.n_optim_cpu]
    assert all(c.pcie_bytes > 0 for c in offloading)
    assert any(c.step_time > plain[_work(c)] for c in offloading)
    # the runtime: half the optimizer and a parameter shard offloaded on a CPU device, no copy
    c = next(c for c in cands if c.n_chunks >= 2 and c.n_optim_cpu == c.n_chunks and c.n_param_cpu)
    plan = search.materialize(c, packings[c.chunk_size], prof, hfe.HardwareProfile.preset("cpu"), 1,
                              "float32", "adamw", c.peak)
    em = hfe.ElixirModule(tiny_gpt2(), plan)
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(em.module.parameters(), lr=1e-3))
    ids = torch.randint(0, 128, (2, 32))
    opt.backward(em(input_ids=ids, labels=ids).loss)
    opt.step()
    counted = em.comm_report()["bytes"]
    assert counted["host_to_device"] == counted["device_to_host"] == 0
    em.close()


def test_fresh_outputs_are_counted_apart_from_reads():
    """An out-of-place add reads two inputs and writes one new tensor; the in-place add
    rewrites mapped memory: no fresh bytes (on a CPU the difference is page faults)."""
    from hf_elixir.profile.memory import LiveStorageTracker

    x = torch.empty(1024, device="meta")
    y = torch.empty(1024, device="meta")
    work = EventWork()
    tracker = LiveStorageTracker(exclude=[x, y])
    tracker.on_op = work.add
    with tracker:
        z = x + y
        z.add_(x)
        z.view(32, 32)  # a view moves nothing
    assert work.ops == 3
    assert work.fresh == {12: 4096.0}  # the one new 4 KiB output (2**12 bytes)
    assert work.read == 2 * 4096 + 2 * 4096  # x and y, then z and x


def test_matmuls_are_kept_by_layout():
    """nn.Linear multiplies by W transposed ("NT") and its backward by W ("NN"); each
    layout is priced at its own measured rate."""
    from hf_elixir.profile.memory import LiveStorageTracker

    lin = torch.nn.Linear(64, 32, bias=False, device="meta")
    x = torch.empty(8, 64, device="meta", requires_grad=True)
    work = EventWork()
    tracker = LiveStorageTracker()
    tracker.on_op = work.add
    with tracker:
        lin(x).sum().backward()
    assert {"NT", "NN"} <= {layout for layout, _ in work.matmul}
    figs = ComputeFigures(matmul_curve={"float32": [[1.0, 1e9]]},
                          matmul_layouts={"float32": {"NT": [[1.0, 1e10]]}})
    assert figs.matmul_rate("float32", 1e6, "NT") == 1e10
    assert figs.matmul_rate("float32", 1e6, "TN") == 1e9  # no curve of its own: the overall one


def test_an_add_across_layouts_is_priced_as_strided():
    """An add of a row-major and a transposed operand reads against one operand's layout;
    it is kept apart from contiguous reads and priced at its own rate."""
    from hf_elixir.profile.memory import LiveStorageTracker

    a = torch.empty(64, 32, device="meta")
    b = torch.empty(32, 64, device="meta").t()
    work = EventWork()
    tracker = LiveStorageTracker(exclude=[a, b])
    tracker.on_op = work.add
    with tracker:
        a + b
        a + a
    assert work.strided == 2 * 64 * 32 * 4  # a and b, against b's layout
    assert work.read == 64 * 32 * 4          # a, read once
    figs = ComputeFigures(matmul_curve={"float32": [[1.0, 1e9]]}, read_bandwidth=1e10, strided_bandwidth=1e9,
                          write_curve=[[1.0, 1e12]], op_overhead=0.0)
    assert price(work, figs, "float32") == pytest.approx(work.strided / 1e9 + work.read / 1e10 + 2 * 8192 / 1e12)
    assert work.fresh == {13: 2 * 8192.0}


def _adopting_plan_step(rank: int, world_size: int, plan_json: str) -> dict:
    """Rank body: one training step of the plan; the ledger's peaks."""
    from hf_elixir.planner.record import ElixirPlan

    model = embedding_heavy_gpt2()
    em = hfe.ElixirModule(model, ElixirPlan.from_json(plan_json))
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(rank))
    opt.backward(em(input_ids=ids, labels=ids).loss)
    report = em.memory_report()
    opt.step()
    opt.zero_grad()
    em.drain()
    return {"peak": report["peak"], "peak_total": report["peak_total"]}


def embedding_heavy_gpt2():
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_a_chunk_of_one_parameter_adopts_autograds_gradient():
    """A chunk holding only the (tied) embedding takes autograd's gradient tensor as its
    buffer: no copy, and no buffer before that gradient exists (the LM head's use at the
    start of backward allocates none). The predicted gradient-buffer peak and the ledger's
    peak equal what two real ranks' ledgers hold."""
    from tests.harness import run_distributed

    prof = profile_model(embedding_heavy_gpt2(), (2, 32), dtype="float32", attention_target="cpu")
    hw = hfe.HardwareProfile.preset("cpu")
    cands, packings = search.enumerate_candidates(prof, hw, 2, "float32", "adamw")
    sizes = {p.name: p.numel for p in prof.params}

    def adopts(c) -> bool:
        elems = packing.layout_sizes(packings[c.chunk_size], sizes, 2, 4)
        return 0 in packing.adopting_chunks(packings[c.chunk_size], sizes, elems)

    c = next(c for c in cands if c.n_chunks >= 3 and adopts(c) and c.n_optim_cpu == 0 and not c.checkpointing)
    assert packings[c.chunk_size][0] == ["transformer.wte.weight"]
    plan = search.materialize(c, packings[c.chunk_size], prof, hw, 2, "float32", "adamw", c.peak)
    per_rank = run_distributed(_adopting_plan_step, 2, plan.to_json())
    mem = plan.predictions["memory"]
    grad_shards = sum(packing.layout_sizes(packings[c.chunk_size], sizes, 2, 4)) // 2 * 4
    held = mem["parameters"] + mem["master_weights"] + mem["optimizer_state"] + mem["rcache"] + grad_shards
    predicted_buffers = plan.predictions["ledger_peak_bytes"] - held
    for res in per_rank:
        # the embedding's gradient is a buffer from the access that completes it, with the
        # two chunks before it still reducing
        assert res["peak"]["grad_buffers"] == predicted_buffers, (res, mem)
        assert res["peak_total"] <= plan.predictions["ledger_peak_bytes"]
