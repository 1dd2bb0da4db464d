"""The disk tier (runtime/disk_tier.py): chunks whose fp32 master and optimizer state live in
files under ``nvme_path``, read ahead and written behind around the host update.

- World size 2, half of the trainable chunks on disk: the weights after 10 steps are those
  of the same plan with those chunks on the host tier, bit for bit; each rank's resident set
  is smaller by at least 80% of the bytes its disk tier holds; the scratch files are gone
  once the ranks exit.
- A checkpoint saved with a disk tier resumes exactly at world size 1 without one, and the
  other way round.
- A stale scratch directory (a crashed run's) is never read as state; a directory a live
  run holds is refused.
- Bad paths fail before anything is changed, with what to do.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hf_elixir as hfe
from harness import run_distributed
from hf_elixir.runtime.disk_tier import DIR_PREFIX, DATA_NAME, LOCK_NAME, DiskTierError, check_path

STEPS = 10
#: the world-size-2 model: 128 layers of 256 x 256, about 17 MiB of Adam state per rank on disk
WIDE, DEEP = 256, 128


VOCAB = 64


class DeepLM(nn.Module):
    """A plain causal LM of ``depth`` equal residual layers (no transformers: workers start
    fast): with ``chunk_size = width**2`` every layer is a chunk of its own, so there are
    many more disk chunks than ring buffers, and half of the chunks is half of the state."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def _model(width: int, depth: int) -> DeepLM:
    torch.manual_seed(0)
    return DeepLM(width, depth)


def _plan(model, world_size: int, chunk_size: int, disk: bool) -> hfe.ElixirPlan:
    """Every trainable chunk on the host tier; with ``disk``, half of them on disk (every
    other one by size, so that they hold about half of the state)."""
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=chunk_size, offload_fraction=1.0)
    if disk:
        for chunk in sorted((c for c in plan.chunks if not c.frozen), key=lambda c: c.numel)[::2]:
            chunk.optim_placement = "disk"
    return plan


def _batches(rank: int, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return [torch.randint(0, VOCAB, (1, 16), generator=g) for _ in range(steps)]


def _run(emodel, opt, batches) -> None:
    for ids in batches:
        opt.backward(emodel(input_ids=ids, labels=ids)["loss"])
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _train_two_ranks(rank: int, world_size: int, disk: bool, nvme: str) -> dict:
    import gc
    import time

    model = _model(WIDE, DEEP)
    emodel = hfe.ElixirModule(model, _plan(model, world_size, WIDE * WIDE, disk), nvme_path=nvme)
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-3))
    start = time.perf_counter()
    _run(emodel, opt, _batches(rank, STEPS))
    emodel.host_updates.wait_all()
    seconds = time.perf_counter() - start
    gc.collect()
    # memory the program freed but the allocator kept (set-up's temporaries) is not held
    # state: hand it back to the system first, in both runs, so the set measures what is live
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss = _rss()
    out = {"rss": rss, "disk_bytes": 0, "read": 0, "chunks": sum(c.disk for c in emodel.chunks),
           "ring_bytes": 0, "seconds": seconds}
    if emodel.disk is not None:
        tier = emodel.disk
        out.update(disk_bytes=tier.state_bytes, read=tier.counters.read_bytes, ring_bytes=tier.ring_bytes,
                   files=sorted(p.name for p in tier.directory.iterdir()))
    # the weights of this rank's shards (the masters: in fp32 the shards themselves)
    out["weights"] = [c.shard.clone() for c in emodel.chunks]
    return out  # no close(): the files must go at a normal exit all the same


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    nvme = tmp_path_factory.mktemp("nvme")
    host = run_distributed(_train_two_ranks, 2, False, str(nvme))
    disk = run_distributed(_train_two_ranks, 2, True, str(nvme))
    return host, disk, nvme


def test_weights_after_10_steps_equal_the_host_tier_bit_for_bit(two_ranks) -> None:
    host, disk, _ = two_ranks
    for h, d in zip(host, disk):
        assert d["chunks"] >= 16 and d["read"] > 0  # more chunks than the ring: state was read back
        assert d["files"] == [LOCK_NAME, DATA_NAME]
        assert len(h["weights"]) == len(d["weights"])
        for a, b in zip(h["weights"], d["weights"]):
            assert torch.equal(a, b)


def test_each_rank_holds_less_by_at_least_80_percent_of_its_disk_bytes(two_ranks) -> None:
    host, disk, _ = two_ranks
    for rank, (h, d) in enumerate(zip(host, disk)):
        assert d["disk_bytes"] > 10 * 2**20, d["disk_bytes"]  # the state dominates the noise
        saved = h["rss"] - d["rss"]
        assert saved >= 0.8 * d["disk_bytes"], (
            f"rank {rank}: resident set {h['rss'] / 2**20:.1f} MiB on the host tier, {d['rss'] / 2**20:.1f} MiB "
            f"with {d['disk_bytes'] / 2**20:.1f} MiB on disk (ring {d['ring_bytes'] / 2**20:.1f} MiB)")


def test_the_scratch_files_are_removed_at_a_normal_exit(two_ranks) -> None:
    _, _, nvme = two_ranks
    assert list(nvme.iterdir()) == []


# ---------------------------------------------------------------------- world size 1
def _one_rank(nvme: str, ckpt: str) -> dict:
    """Continuous training against save/resume across the tiers, and a stale directory."""
    def build(disk: bool, path: str = nvme):
        model = _model(64, 12)
        emodel = hfe.ElixirModule(model, _plan(model, 1, 64 * 64, disk), nvme_path=path)
        return emodel, hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-2))

    first, second = _batches(0, 3, 1), _batches(0, 3, 2)
    out = {}
    emodel, opt = build(False)
    _run(emodel, opt, first + second)
    out["continuous"] = emodel.state_dict()
    out["continuous_opt"] = opt.state_dict()
    emodel.close()
    for saver, loader in ((True, False), (False, True)):
        emodel, opt = build(saver)
        _run(emodel, opt, first)
        hfe_checkpoint_save(emodel, opt, f"{ckpt}-{saver}")
        emodel.close()
        emodel, opt = build(loader)
        hfe_checkpoint_load(emodel, opt, f"{ckpt}-{saver}")
        _run(emodel, opt, second)
        out[f"resumed_{saver}"] = emodel.state_dict()
        out[f"resumed_opt_{saver}"] = opt.state_dict()
        out[f"disk_{saver}"] = (sum(c.disk for c in emodel.chunks), emodel.disk.counters.read_bytes
                                if emodel.disk else 0)
        emodel.close()
        out[f"left_{saver}"] = sorted(os.listdir(nvme))
    return out


def hfe_checkpoint_save(emodel, opt, path: str) -> None:
    from hf_elixir import checkpoint

    checkpoint.save(emodel, opt, path)


def hfe_checkpoint_load(emodel, opt, path: str) -> None:
    from hf_elixir import checkpoint

    checkpoint.load(emodel, opt, path)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _assert_same_opt(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        _assert_same(a["state"][i], b["state"][i])


def _cross_resume(rank: int, world_size: int, nvme: str, ckpt: str) -> dict:
    return _one_rank(nvme, ckpt)


def test_checkpoints_cross_resume_between_disk_and_no_disk_at_world_size_1(tmp_path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = run_distributed(_cross_resume, 1, str(nvme), str(tmp_path / "ckpt"))[0]
    assert out["disk_True"][0] == 0 and out["disk_False"][0] > 3  # the loader of each
    assert out["disk_False"][1] > 0  # loaded into the files and read back from them
    for saver in (True, False):
        _assert_same(out["continuous"], out[f"resumed_{saver}"])
        _assert_same_opt(out["continuous_opt"], out[f"resumed_opt_{saver}"])
        assert out[f"left_{saver}"] == []


def _stale(rank: int, world_size: int, nvme: str) -> dict:
    torch.set_num_threads(1)
    model = _model(64, 12)
    plan = _plan(model, 1, 64 * 64, True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emodel = hfe.ElixirModule(model, plan, nvme_path=nvme)
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _run(emodel, opt, _batches(0, 3))
    weights = emodel.state_dict()
    emodel.close()
    model = _model(64, 12)
    emodel = hfe.ElixirModule(model, _plan(model, 1, 64 * 64, False))
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _run(emodel, opt, _batches(0, 3))
    return {"warnings": [str(w.message) for w in caught], "disk": weights, "host": emodel.state_dict(),
            "left": sorted(os.listdir(nvme))}


def test_a_stale_scratch_directory_is_never_read_as_state(tmp_path) -> None:
    stale = tmp_path / f"{DIR_PREFIX}00000"
    stale.mkdir()
    (stale / LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": "crashed", "run": "old"}))
    # garbage where the state would be, larger than this run's file: were any of it read as
    # optimizer state or master weights, the weights would differ (or be NaN)
    (stale / DATA_NAME).write_bytes(torch.full((1 << 20,), float("nan")).numpy().tobytes())
    (stale / "leftover.tmp").write_bytes(b"x" * 100)
    out = run_distributed(_stale, 1, str(tmp_path))[0]
    assert any("did not exit cleanly" in w and "crashed" in w for w in out["warnings"]), out["warnings"]
    _assert_same(out["host"], out["disk"])
    assert out["left"] == []


def test_a_directory_held_by_a_live_run_is_refused(tmp_path) -> None:
    held = tmp_path / f"{DIR_PREFIX}00000"
    held.mkdir()
    fd = os.open(held / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    os.write(fd, b'{"pid": 1, "run": "alive"}')
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        model = _model(64, 4)
        with pytest.raises(DiskTierError, match="in use by another live run .*alive.*its own nvme_path"):
            hfe.ElixirModule(model, _plan(model, 1, 64 * 64, True), nvme_path=str(tmp_path))
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- bad input
def _untouched(model) -> bool:
    return all(type(p) is torch.nn.Parameter and p.numel() > 0 and p.data.abs().sum() > 0
               for p in model.parameters() if p.dim() > 1)


@pytest.mark.parametrize("case", ["missing", "a file", "not writable", "no path"])
def test_bad_paths_fail_before_anything_changes(case, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("ELIXIR_NVME_PATH", raising=False)
    path = {"missing": str(tmp_path / "absent"), "a file": str(tmp_path / "file"),
            "not writable": "/proc", "no path": None}[case]
    (tmp_path / "file").write_text("x")
    expected = {"missing": "does not exist; create the directory", "a file": "is not a directory",
                "not writable": "is not writable .* name a directory this user can write",
                "no path": "no directory was given for it; pass nvme_path="}[case]
    model = _model(64, 4)
    with pytest.raises(DiskTierError, match=expected):
        hfe.ElixirModule(model, _plan(model, 1, 64 * 64, True), nvme_path=path)
    assert _untouched(model)  # nothing was sharded


def test_too_little_space_names_the_bytes_needed_and_available(tmp_path) -> None:
    with pytest.raises(DiskTierError, match=r"free \(\d+ bytes\) but the disk tier needs .* \(\d+ bytes for 2 ranks\)"):
        check_path(tmp_path, 1 << 60, ranks=2)


def test_the_path_comes_from_the_environment_and_the_plugin_checks_it(tmp_path, monkeypatch) -> None:
    from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin

    monkeypatch.setenv("ELIXIR_NVME_PATH", str(tmp_path))
    assert ElixirPlugin().nvme_path == str(tmp_path)
    model = _model(64, 4)
    emodel = hfe.ElixirModule(model, _plan(model, 1, 64 * 64, True))
    assert emodel.disk is not None and emodel.disk.directory.parent == tmp_path
    emodel.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ElixirConfigError, match="nvme_path .* does not exist"):
        ElixirPlugin(nvme_path=str(tmp_path / "absent"))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
def test_bf16_masters_on_disk_equal_the_host_tier(optimizer, tmp_path) -> None:
    """In bf16 the fp32 master is not the shard: the file holds it too (a third plane)."""
    def make(params):
        if optimizer == "adamw":
            return torch.optim.AdamW(params, lr=1e-2)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    out = []
    for disk in (False, True):
        model = _model(64, 12)
        plan = _plan(model, 1, 64 * 64, disk)
        plan.compute_dtype = "bfloat16"
        emodel = hfe.ElixirModule(model, plan, nvme_path=str(tmp_path))
        # the disk tier's updates inside step() (sgd) and behind the next forward (adamw)
        opt = hfe.ElixirOptimizer(emodel, make(model.parameters()), overlap_host=not disk or optimizer == "adamw")
        if disk:
            assert all("master" in c.planes for c in emodel.disk.chunks.values())
        _run(emodel, opt, _batches(0, 4))
        out.append((emodel.state_dict(), opt.state_dict()))
        emodel.close()
    _assert_same(out[0][0], out[1][0])
    _assert_same_opt(out[0][1], out[1][1])
    assert list(tmp_path.iterdir()) == []
