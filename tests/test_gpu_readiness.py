"""Issue 10: the CUDA/NCCL code paths, exercised as far as a CPU allows.

Each test stands for one point of the issue: inputs moved to the compute device, the device
chosen explicitly, the backend chosen by the device, the collective names of older torch
releases, the offload paths a CUDA device takes (run here with stand-ins for the stream
API), agreement across ranks on late chunks and on the recorded trace, 16-byte offsets,
world size 1 gathered in place, one host sync per device, and the torch floor in setup.cfg.
"""

from __future__ import annotations

import collections
import configparser
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hf_elixir as hfe
from equivalence import assert_matches, elixir_run, reference_run
from harness import run_distributed
from hf_elixir.runtime import comm as comm_mod
from hf_elixir.runtime import devices, grad_shards
from hf_elixir.runtime import module as module_mod
from loops import elixir_steps, lm_loss
from test_equivalence import case_plans
from tiny_models import make_batch, make_model

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- inputs and device
def test_move_to_device_reaches_every_nested_tensor() -> None:
    Pair = collections.namedtuple("Pair", "a b")
    cpu = torch.ones(2)
    obj = {"ids": cpu, "nested": [cpu, (cpu, 3)], "pair": Pair(cpu, "x"), "n": None}
    moved = devices.move_to_device(obj, torch.device("meta"))
    assert moved["ids"].is_meta and moved["nested"][0].is_meta and moved["nested"][1][0].is_meta
    assert moved["nested"][1][1] == 3 and moved["n"] is None
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.is_meta and moved["pair"].b == "x"
    assert cpu.device.type == "cpu", "the caller's tensors are not changed"


def test_forward_and_generate_move_inputs_to_the_compute_device() -> None:
    """The wrapper hands the model inputs on its compute device (here a stand-in, meta)."""
    model = make_model("gpt2")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096))
    seen = {}

    def record(name):
        def fn(*args, **kwargs):
            seen[name] = [t.device.type for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
            return None
        return fn

    model.forward = record("forward")
    model.generate = record("generate")
    em.device = torch.device("meta")
    ids = make_batch(2, 4)
    em(ids, labels=ids, attention_mask={"mask": torch.ones(2, 4)}["mask"])
    em.generate(ids, max_new_tokens=1)
    assert seen["forward"] == ["meta", "meta", "meta"]
    assert seen["generate"] == ["meta"]


@pytest.fixture
def four_gpus(monkeypatch):
    """A machine with four CUDA devices, as far as device choice can tell."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(int(i)))
    return calls


def test_the_device_follows_local_rank_and_is_made_current(four_gpus, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert devices.resolve_device() == torch.device("cuda", 2)
    assert four_gpus == [2]
    assert devices.resolve_device("cuda:1") == torch.device("cuda", 1) and four_gpus == [2, 1]
    assert devices.resolve_device("cpu") == torch.device("cpu") and four_gpus == [2, 1]
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(RuntimeError, match="4 CUDA devices are visible"):
        devices.resolve_device()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one visible device per rank
    assert devices.resolve_device() == torch.device("cuda", 0)


def test_device_cpu_forces_the_cpu_on_a_gpu_machine(four_gpus) -> None:
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096, offload_fraction=0.5),
                          device="cpu")
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = make_batch(2, 8)
    eopt.backward(em(input_ids=ids, labels=ids).loss)
    eopt.step()
    assert four_gpus == [] and em.copy_stream is None
    tensors = [t for c in em.chunks for t in (c.shard, c.master, c.grad_shard, c.full)]
    assert all(t.device.type == "cpu" for t in tensors) and all(c.staging is None for c in em.chunks)


# ---------------------------------------------------------------------- backend and collective names
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_backend_is_chosen_by_the_device(device: str) -> None:
    assert comm_mod.backend_for(torch.device(device)) == ("nccl" if device == "cuda" else "gloo")


def test_a_host_tensor_never_enters_a_device_collective() -> None:
    comm = comm_mod.Collectives(rank=0, world_size=2, device=torch.device("meta"))
    with pytest.raises(RuntimeError, match="copied to the device first"):
        comm.all_gather(torch.empty(4, device="meta"), torch.empty(2))


FALLBACK = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _with_old_collective_names(rank: int, world_size: int) -> tuple[dict, dict]:
    """A torch without the 2.13 names, the tensor collectives forced on gloo (the NCCL path)."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # the old names warn on 2.13
    calls = dict.fromkeys(FALLBACK.values(), 0)
    for new, old in FALLBACK.items():
        if hasattr(dist, new):
            delattr(dist, new)
        real = getattr(dist, old)

        def counted(*args, _real=real, _name=old, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, old, counted)
    os.environ[comm_mod.COLLECTIVES_ENV] = "tensor"
    plans = case_plans("gpt2")
    runs = {name: elixir_run(rank, world_size, "gpt2", plans[name])
            for name in ("a_all_device", "b_rcache2", "d_all_cpu")}
    return runs, calls


def test_older_collective_names_train_like_pytorch() -> None:
    runs, calls = run_distributed(_with_old_collective_names, 2)[0]
    assert calls["all_gather_into_tensor"] > 0 and calls["reduce_scatter_tensor"] > 0
    ref = reference_run("gpt2")
    for name, got in runs.items():
        assert_matches(ref, got, label=f"old names/{name}")


# ---------------------------------------------------------------------- offloaded gradients
class _FakeEvent:
    """Stands in for a CUDA event (host work is already ordered): counts records."""

    recorded = 0

    def record(self, stream=None) -> None:
        _FakeEvent.recorded += 1

    def synchronize(self) -> None:
        pass


class _FakeStream:
    """Stands in for a CUDA stream: counts host waits, accepts every ordering call."""

    def __init__(self) -> None:
        self.synchronized = 0
        self.waits_for_streams = 0

    def synchronize(self) -> None:
        self.synchronized += 1

    def wait_stream(self, other) -> None:
        self.waits_for_streams += 1

    def wait_event(self, event) -> None:
        pass

    def record_event(self) -> _FakeEvent:
        event = _FakeEvent()
        event.record(self)
        return event


def _use_stand_in_streams() -> tuple[_FakeStream, _FakeStream]:
    """In a worker process: the CUDA stream API becomes stand-ins, and wrapped models get a
    copy stream, a download stream and the host buffers a CUDA device would (plain host
    tensors here). Returns the compute stream (also the copy stream) and the download stream."""
    import contextlib

    stream, downloads = _FakeStream(), _FakeStream()
    torch.cuda.current_stream = lambda device=None: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.Event = _FakeEvent

    def host_buffers(self, layout):
        self.copy_stream, self.download_stream = stream, downloads
        W = self.comm.world_size

        def pool(kind: str) -> dict:
            return {i: torch.empty(layout[i][0] // W, dtype=self.dtype)
                    for i, c in enumerate(self.plan.chunks) if getattr(c, kind) == "cpu"}

        return pool("param_placement"), pool("optim_placement")

    module_mod.ElixirModule._host_buffers = host_buffers
    return stream, downloads


def _staged_offload(rank: int, world_size: int) -> dict:
    """The path a CUDA device takes for chunks whose optimizer runs on the host, with the
    CUDA stream API replaced by stand-ins: reduced shards go down into staging buffers on the
    download stream (after the kernels queued before it), the host waits for that stream once
    per backward and adds them in, never for the compute stream; updated shards are cast into
    the staging buffer and go up on the copy stream, chunk by chunk."""
    os.environ[comm_mod.COLLECTIVES_ENV] = "tensor"  # NCCL's reduce-scatter into a device scratch
    # bf16: on the CPU an fp32 master would be the shard itself (nothing to upload)
    plan = dict(case_plans("llama")["c_half_optim_cpu"], compute_dtype="bf16")
    plain = elixir_run(rank, world_size, "llama", plan)
    plain_late = elixir_run(rank, world_size, "llama", plan, on_wrap="late_on_rank_0")
    stream, downloads = _use_stand_in_streams()
    got = elixir_run(rank, world_size, "llama", plan)
    waits, uploads, compute_waits = downloads.synchronized, _FakeEvent.recorded, stream.synchronized
    ordered = downloads.waits_for_streams
    # a late (staged) chunk comes down a second time: its first download is added in first
    late = elixir_run(rank, world_size, "llama", plan, on_wrap="late_on_rank_0")
    return {"run": got, "plain": plain, "late": late, "plain_late": plain_late, "waits": waits, "uploads": uploads,
            "compute_waits": compute_waits, "ordered_downloads": ordered,
            "staged": sum(c.optim_placement == "cpu" for c in hfe.ElixirPlan.simple(
                make_model("llama"), world_size, **plan).chunks)}


def test_offloaded_state_goes_through_staging_with_one_wait_per_backward() -> None:
    from equivalence import ACCUM, STEPS

    got = run_distributed(_staged_offload, 2)[0]
    assert got["staged"] > 1
    assert got["waits"] == ACCUM * STEPS, "one host wait per backward, not one per chunk"
    assert got["compute_waits"] == 0, "the host waits for the downloads, not for backward's kernels"
    # each download waits on the device for the kernels queued before it, once per chunk
    assert got["ordered_downloads"] == ACCUM * STEPS * got["staged"]
    # per step: the readers' event, then one upload per staged chunk
    assert got["uploads"] == STEPS * (1 + got["staged"])
    # the same arithmetic as the direct path, in the same order: bit for bit
    for staged, plain in ((got["run"], got["plain"]), (got["late"], got["plain_late"])):
        assert staged["losses"] == plain["losses"]
        assert all(torch.equal(staged["state"][k], v) for k, v in plain["state"].items())
    assert got["late"]["forced_late"] and all(got["late"]["forced_late"])


def _zero_grad_of_staged_chunks(rank: int, world_size: int) -> dict:
    """``zero_grad`` on chunks whose gradient comes down through staging: marked, not cleared."""
    from equivalence import make_optimizer

    os.environ[comm_mod.COLLECTIVES_ENV] = "tensor"
    _use_stand_in_streams()
    torch.manual_seed(0)
    model = make_model("llama")
    plan = hfe.ElixirPlan.simple(model, world_size, **dict(case_plans("llama")["c_half_optim_cpu"], compute_dtype="bf16"))
    emodel = hfe.ElixirModule(model, plan)
    eopt = hfe.ElixirOptimizer(emodel, make_optimizer(model)[0])
    staged = [c for c in emodel.chunks if c.staging is not None and not c.frozen]
    ids = make_batch(4, 16)
    eopt.backward(lm_loss(emodel, ids))
    eopt.step()
    emodel.host_updates.wait_all()
    held = [c.grad_shard.clone() for c in staged]
    eopt.zero_grad()
    out = {"staged": len(staged), "marked": [c.grad_zeroed for c in staged],
           "untouched": [torch.equal(c.grad_shard, h) and bool(h.any()) for c, h in zip(staged, held)]}
    out["norm_after_zero_grad"] = float(eopt.clip_grad_norm_(1.0))  # a reader: it sees zeros
    out["settled"] = [not c.grad_zeroed and not c.grad_shard.any() for c in staged]
    eopt.zero_grad()
    eopt.backward(lm_loss(emodel, ids))  # the download is copied over what the shard held
    out["copied"] = [not c.grad_zeroed for c in staged]
    out["norm_after_backward"] = float(eopt.clip_grad_norm_(1.0))
    return out


def test_zero_grad_marks_a_staged_shard_zero_and_every_reader_sees_zeros() -> None:
    """A staged chunk's ``zero_grad`` writes nothing: the next download is copied in over the
    shard (one pass saved of the two that clearing and adding cost). Any other reader, here
    clipping, clears the shard first, so it reads zeros as it would after a real clearing."""
    got = run_distributed(_zero_grad_of_staged_chunks, 2)[0]
    assert got["staged"] > 1
    assert all(got["marked"]) and all(got["untouched"]), "zero_grad must only mark the staged shards"
    assert got["norm_after_zero_grad"] == 0.0 and all(got["settled"])
    assert all(got["copied"]) and got["norm_after_backward"] > 0.0


def _host_gathers(rank: int, world_size: int) -> dict:
    """Offloaded parameters as a CUDA device gathers them: the host shard goes up on the copy
    stream (into the block at world size 1, into a device copy then the gather otherwise).
    The compute device is ``cpu:0``, which differs from the host shards' ``cpu``, so the
    runtime takes that path; the CUDA stream API is replaced by stand-ins."""
    os.environ[comm_mod.COLLECTIVES_ENV] = "tensor"
    _use_stand_in_streams()
    got = elixir_run(rank, world_size, "gpt2", case_plans("gpt2")["d_all_cpu"], device="cpu:0")
    return dict(got, host_reads=_FakeEvent.recorded)


@pytest.mark.parametrize("world_size", [1, 2])
def test_offloaded_parameters_are_gathered_from_the_host_on_the_copy_stream(world_size: int) -> None:
    from equivalence import STEPS

    got = run_distributed(_host_gathers, world_size)[0]
    gathers = got["memory"]["cache_stats"]["gathers"]
    assert gathers > 0 and got["host_reads"] == gathers + STEPS  # + each step's readers' event
    assert_matches(reference_run("gpt2"), got, label=f"host gathers W{world_size}")


# ---------------------------------------------------------------------- agreement across ranks
def _late_on_rank_0(rank: int, world_size: int) -> dict:
    return elixir_run(rank, world_size, "gpt2", dict(chunk_size=4096), on_wrap="late_on_rank_0")


def test_a_late_chunk_on_one_rank_is_reduced_on_every_rank() -> None:
    """Rank 0 alone gets a gradient for a chunk that already went; had it issued the extra
    reduce-scatter alone, the ranks' collectives would no longer pair up (a hang, caught by
    the harness's timeout)."""
    results = run_distributed(_late_on_rank_0, 2, timeout=180)
    assert results[0]["forced_late"] and all(results[0]["forced_late"]), "the chunk must really be late"
    assert results[1]["forced_late"] == []
    assert_matches(reference_run("gpt2"), results[0], label="late on rank 0")


def _different_traces(rank: int, world_size: int) -> dict:
    return elixir_run(rank, world_size, "gpt2", dict(chunk_size=4096), on_wrap="extra_request_on_rank_0")


def test_ranks_that_recorded_different_orders_all_drop_the_trace() -> None:
    """Prefetching along a trace only one rank recorded would issue gathers the others do
    not; the ranks compare their recordings and drop them together, then record again."""
    results = run_distributed(_different_traces, 2, timeout=180)
    for got in results:
        stats = got["memory"]["cache_stats"]
        assert stats["trace_disagreements"] == 1 and stats["prefetches"] > 0
    assert_matches(reference_run("gpt2"), results[0], label="different traces")


# ---------------------------------------------------------------------- layout
class OddSizes(nn.Module):
    """Parameters whose sizes are not multiples of 4 or 8 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(torch.relu(self.a(x)))).sum()


ODD_BATCH = {"x": torch.zeros(2, 7)}  # what simple() traces OddSizes with


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_parameter_offsets_and_shards_are_16_byte_aligned(dtype: str) -> None:
    model = OddSizes()
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=256, compute_dtype=dtype, example_batch=ODD_BATCH))
    item = em.dtype.itemsize
    assert len(em.chunks) == 1 and len(em.slots) == 6
    assert all(s.offset * item % 16 == 0 for s in em.slots)
    assert any(s.numel * item % 16 for s in em.slots), "the case must need padding"
    assert all(c.shard_size * item % 16 == 0 for c in em.chunks)
    em.fetcher.fetch([0])  # every gathered view starts 16-byte aligned in memory
    assert all(s.param.data_ptr() % 16 == 0 for s in em.slots)
    em.fetcher.unpin([0])


def _aligned_shards(rank: int, world_size: int) -> list[int]:
    model = OddSizes()
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=258, compute_dtype="bf16", example_batch=ODD_BATCH))
    return [c.shard_size for c in em.chunks]


def test_shard_boundaries_are_aligned_at_world_size_3() -> None:
    for shard_size in run_distributed(_aligned_shards, 3)[0]:
        assert shard_size * 2 % 16 == 0


def test_alignment_gaps_are_zeroed_before_a_reduction() -> None:
    """Gaps between aligned parameters would otherwise carry garbage (NaN, inf) into the
    gradient shards, the clipping norm and the overflow check."""
    model = OddSizes()
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=256, example_batch=ODD_BATCH))
    chunk = em.chunks[0]
    chunk.grad_buffer = torch.full((chunk.size,), float("nan"))
    chunk.grads_received = {s.index for s in chunk.slots}
    chunk.zero_missing_grads()
    inside = torch.zeros(chunk.size, dtype=torch.bool)
    for s in chunk.slots:
        inside[s.offset : s.offset + s.numel] = True
    assert torch.isnan(chunk.grad_buffer[inside]).all()
    assert (chunk.grad_buffer[~inside] == 0).all() and (~inside).any()


def test_world_size_1_gathers_in_place_and_accumulates_into_the_shard() -> None:
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096, rcache_blocks=2))
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert all(c.full is c.shard for c in em.chunks)
    weight = model.model.layers[0].mlp.up_proj.weight
    chunk = next(c for c in em.chunks if any(s.param is weight for s in c.slots))
    ptrs = []
    model.model.layers[0].mlp.up_proj.register_forward_pre_hook(
        lambda m, a: ptrs.append(weight.untyped_storage().data_ptr()))
    elixir_steps(em, eopt, [make_batch(2, 8)] * 2)
    assert ptrs == [chunk.shard.untyped_storage().data_ptr()] * 2, "the parameter views the shard itself"
    report = em.memory_report()
    assert report["peak"]["rcache"] == 0 and report["peak"]["grad_buffers"] == 0
    assert report["cache_stats"]["gathers"] > 0 and report["cache_stats"]["evictions"] == 0


# ---------------------------------------------------------------------- host syncs
class _HostReads:
    """Counts the ways a tensor's value reaches the host (each one a device sync on CUDA)."""

    NAMES = ("cpu", "item", "__bool__", "tolist")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def counted(t, *args, _real=real, **kwargs):
                self.count += 1
                return _real(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clipping_and_overflow_checks_read_the_host_once_per_device(monkeypatch, norm_type) -> None:
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096, pack_size=512))
    eopt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = make_batch(2, 8)
    eopt.backward(em(input_ids=ids, labels=ids).loss)
    assert len(em.chunks) > 8, "the case needs many chunks"
    reads = _HostReads(monkeypatch)
    eopt.clip_grad_norm_(1.0, norm_type=norm_type)
    assert reads.count <= 1
    reads.count = 0
    assert eopt._found_inf() is False
    assert reads.count <= 2  # the per-device flag, then the agreed flag


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_with_every_shard_on_one_device_clipping_never_reads_the_host(monkeypatch, norm_type) -> None:
    """Nothing offloaded: the norm, its all-reduce and the factor stay on the shards' device,
    as in ``torch.nn.utils.clip_grad_norm_``, so on a GPU the host goes on queueing work
    instead of waiting for the backward. The device is a stand-in here (meta), the shards'
    own device for every chunk: a value read or copied from it to the host would raise."""
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096, pack_size=512))
    for chunk in em.chunks:
        chunk.grad_shard = torch.empty_like(chunk.grad_shard, device="meta")
    reads = _HostReads(monkeypatch)
    total = grad_shards.clip(em.chunks, em.disk, em.comm, 1.0, norm_type)
    assert total.device.type == "meta" and reads.count == 0


# ---------------------------------------------------------------------- the torch floor
#: APIs the runtime calls, with the first torch release that has them (checked against the
#: PyTorch release notes and pull requests cited)
TORCH_APIS = {
    "fused AdamW/Adam kernels on CPU tensors (pytorch#123074)": (2, 4),
    "Tensor.register_post_accumulate_grad_hook": (2, 1),
    "Module.register_forward_hook(always_call=...)": (2, 1),
    "dist.new_group(use_local_synchronization=...)": (2, 1),
    "dist.all_gather_into_tensor / reduce_scatter_tensor (fallback names)": (1, 13),
    "torch.dtype.itemsize": (2, 1),
}


def _torch_requirement() -> tuple[tuple[int, int], tuple[int, int]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    req = next(r for r in cfg["options"]["install_requires"].split("\n") if r.strip().startswith("torch"))
    low = re.search(r">=\s*(\d+)\.(\d+)", req)
    high = re.search(r"<\s*(\d+)\.(\d+)", req)
    return (int(low[1]), int(low[2])), (int(high[1]), int(high[2]))


def test_the_torch_floor_covers_every_api_the_runtime_uses() -> None:
    floor, ceiling = _torch_requirement()
    needed = max(TORCH_APIS.values())
    assert floor >= needed, f"setup.cfg accepts torch {floor} but the runtime needs {needed}"
    installed = tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert floor <= installed < ceiling
    assert hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
    import torch.distributed as dist

    assert all(hasattr(dist, old) for old in FALLBACK.values())
