"""Issue 38's planning half: the disk tier in the search, its price, the CLI and the disk's
calibration. Planning only (meta device), no training: the 13B Llama-shaped config is profiled
once and searched several ways."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from hf_elixir.cli import main as cli_main
from hf_elixir.hardware import HardwareProfile
from hf_elixir.measure import disk as mdisk
from hf_elixir.planner import disk
from hf_elixir.planner.candidate import Candidate
from hf_elixir.planner.record import PlanError
from hf_elixir.planner.search import plan as search
from hf_elixir.profile.configs import known_config
from hf_elixir.profile.profiler import profile_model

GiB = 2**30


@pytest.fixture(scope="module")
def llama13b():
    cfg = known_config("llama-2-13b")
    return cfg, profile_model(cfg, (1, 1024), dtype="bfloat16", attention_target="cuda")


def _plan(llama13b, host: str, nvme: bool, disk_free: int | None = None):
    cfg, prof = llama13b
    hw = HardwareProfile.preset("rtx4090").with_cluster(gpus_per_node=1)
    hw.disk_free = disk_free
    return search(cfg, (1, 1024), hardware=hw, world_size=1, dtype="bf16", profile=prof,
                  efficiency="calibrated", host_memory=host, nvme=nvme)


def test_cli_plans_13b_with_the_remainder_on_disk(tmp_path, capsys) -> None:
    # the fp32 gradient shards (4 B per parameter, 48 GiB) go to disk with the optimizer
    # state (runtime/disk_grads.py): host memory holds compute-dtype shards and the rings
    out = tmp_path / "plan.json"
    rc = cli_main(["plan", "llama-2-13b", "--hardware", "rtx4090", "--gpus", "1", "--host-memory", "64GiB",
                   "--nvme", "--efficiency", "calibrated", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "tiers per rank: device" in text and "disk traffic per step" in text
    assert re.search(r"chosen .* \d+/\d+ \(\d+ disk\)", text), text  # the table counts disk chunks
    data = json.loads(out.read_text())
    placements = [c["optim_placement"] for c in data["chunks"] if not c["frozen"]]
    assert "disk" in placements
    # trailing chunks first: every disk chunk comes after every host and device chunk
    first = placements.index("disk")
    assert all(p == "disk" for p in placements[first:])
    pred = data["predictions"]
    assert pred["disk"]["bytes_per_rank"] > 0 and pred["time"]["disk_io"] > 0
    assert pred["host_bytes_per_rank"] <= 0.9 * 64 * GiB
    assert pred["step_time_s"] >= pred["time"]["exposed_disk"]


def test_too_little_host_names_the_floor_with_disk_and_64gib_fails_without(llama13b) -> None:
    with pytest.raises(PlanError, match="with every offloaded optimizer on disk") as with_disk:
        _plan(llama13b, "16GiB", nvme=True)  # the compute-dtype shards and the rings alone
    assert "14.40 GiB usable of 16.00 GiB" in str(with_disk.value)
    with pytest.raises(PlanError, match="CPU memory per node, more than the 57.60 GiB") as without:
        _plan(llama13b, "64GiB", nvme=False)
    assert "on disk" not in str(without.value)


def test_too_small_a_disk_says_how_much_more(llama13b) -> None:
    with pytest.raises(PlanError, match=r"more is needed") as err:
        _plan(llama13b, "64GiB", nvme=True, disk_free=10 * GiB)
    msg = str(err.value)
    assert f"{10 * GiB} bytes) is available" in msg
    need = int(msg.split("free disk")[0].split("(")[-1].split(" bytes")[0])
    assert need > 10 * GiB
    ok = _plan(llama13b, "64GiB", nvme=True, disk_free=need)
    assert ok.predictions["disk"]["bytes_per_node"] <= need


def test_cli_nvme_size_and_flags(capsys) -> None:
    assert cli_main(["plan", "gpt2", "--hardware", "rtx4090", "--nvme-size", "1GB"]) == 2
    assert "add --nvme" in capsys.readouterr().err
    assert cli_main(["plan", "gpt2", "--hardware", "rtx4090", "--host-memory", "lots"]) == 2


def _cand(**kw) -> Candidate:
    base = dict(chunk_size=100_000_000, n_chunks=4, checkpointing=False, rcache_blocks=2, prefetch_depth=1,
                n_optim_cpu=4, n_param_cpu=0, peak=1.0, step_time=1.0, comm_bytes=0.0, pcie_bytes=0.0,
                memory={}, gathers=0, host_ready=1.0,
                time={"forward_backward": 0.9, "device_optimizer": 0.1, "cpu_optimizer": 0.05})
    base.update(kw)
    return Candidate(**base)


def test_disk_price_grows_with_bytes_and_shrinks_with_bandwidth() -> None:
    hw = HardwareProfile.preset("rtx4090")
    fast = replace(hw, disk_read_bandwidth=8e9, disk_write_bandwidth=4e9)
    assert disk.disk_seconds(2e9, 1, hw) > disk.disk_seconds(1e9, 1, hw) > 0
    assert disk.disk_seconds(1e9, 1, fast) < disk.disk_seconds(1e9, 1, hw)
    assert disk.disk_seconds(1e9, 2, hw) == pytest.approx(2 * disk.disk_seconds(1e9, 1, hw))
    c = _cand()
    one, two = disk.priced(c, 1, 1, "adamw", hw), disk.priced(c, 2, 1, "adamw", hw)
    assert disk.priced(c, 0, 1, "adamw", hw).step_time == c.step_time
    assert c.step_time < one.step_time < two.step_time
    assert disk.priced(c, 2, 1, "adamw", fast).step_time < two.step_time
    # the host update hides what it can: exposed = max(0, disk time - host update time)
    assert one.time["exposed_disk"] == pytest.approx(max(0.0, one.time["disk_io"] - 0.05))
    # on disk: fp32 master, the tier's state planes (as many as the table's largest state,
    # whatever the optimizer keeps: the files are laid out before it is known) and gradient
    assert disk.bytes_per_element("adamw") == 16 and disk.bytes_per_element("sgd") == 16
    # in host memory: the optimizer's own state
    assert disk.host_bytes_per_element("adamw") == 16 and disk.host_bytes_per_element("sgd") == 12


def test_disk_calibration_measures_a_temp_dir_and_caches_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_ELIXIR_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "disk"
    target.mkdir()
    figs = mdisk.disk_figures(target, block_bytes=2**20, total_bytes=8 * 2**20)
    assert figs.read_bytes_per_s > 0 and figs.write_bytes_per_s > 0 and figs.block_bytes == 2**20
    assert list(target.iterdir()) == []  # the probe file is gone
    assert str(target.resolve()) in json.loads(mdisk.disk_cache_path().read_text())

    def measured_again(*a, **k):
        raise AssertionError("a cached disk was measured again")

    monkeypatch.setattr(mdisk, "measure_disk", measured_again)
    assert mdisk.disk_figures(target) == figs
    hw = mdisk.with_disk("rtx4090", target)
    assert hw.disk_read_bandwidth == figs.read_bytes_per_s and hw.disk_free > 0
    assert hw.sources["disk_read_bandwidth"] == "measured"


def test_placement_takes_the_fewest_disk_chunks_a_scan_would(llama13b) -> None:
    """``disk.place`` bisects the count of disk chunks; every candidate gets the count a scan
    from zero finds (the first disk chunk brings the rings, so it can need more host memory
    than none: the scan and the bisection must agree there too)."""
    from hf_elixir.planner.search import _host_bytes, enumerate_candidates

    cfg, prof = llama13b
    hw = HardwareProfile.preset("rtx4090").with_cluster(gpus_per_node=1)
    cands = enumerate_candidates(prof, hw, 1, "bfloat16", "adamw")[0][::40]

    def host(c):
        return _host_bytes(c, 1, "bfloat16", "adamw")

    counts = set()
    for budget in (8 * GiB, 24 * GiB, 48 * GiB, 96 * GiB, 400 * GiB):
        want = []
        for c in cands:
            for q in range(c.n_optim_cpu + 1):
                d = disk.priced(c, q, 1, "adamw", hw)
                if host(d) <= budget:
                    want.append(d)
                    break
        got = disk.place(cands, host, budget, 1, "adamw", hw, float("inf"))
        assert got == want, budget
        counts |= {d.n_optim_disk for d in got}
    assert 0 in counts and len(counts) > 5  # none on disk, and many counts between
    c = next(c for c in cands if c.n_optim_cpu >= 2)
    by_count = [host(disk.priced(c, q, 1, "adamw", hw)) for q in range(c.n_optim_cpu + 1)]
    assert by_count[1] > by_count[0]  # the rings outweigh the one chunk they bring
    assert all(a > b for a, b in zip(by_count[1:], by_count[2:]))  # then each chunk only takes away
