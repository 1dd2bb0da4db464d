"""Hardware profiles: presets with sources, memory strings, JSON, detect and calibrate."""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_elixir.hardware import GB, GiB, PRESETS, HardwareError, HardwareProfile, parse_memory
from hf_elixir.measure import calibrate_machine
from integration_helpers import CALIBRATION

REQUIRED = ["a100-40g", "a100-80g", "h100-80g", "h200", "l4", "t4", "v100-32g", "rtx3090", "rtx4090", "cpu"]
FIGURES = ["device_memory", "h2d_bandwidth", "d2h_bandwidth", "collective_bandwidth", "matmul_flops",
           "device_adam_throughput", "cpu_adam_throughput", "cpu_memory"]


def test_every_preset_exists_and_says_where_each_figure_comes_from():
    assert sorted(REQUIRED) == sorted(PRESETS)
    for name in REQUIRED:
        p = HardwareProfile.preset(name)
        for f in FIGURES:
            assert p.sources.get(f) in {"datasheet", "published measurement", "estimate"}, (name, f)
        assert p.device_memory > 0 and all(v > 0 for v in p.matmul_flops.values())
    assert HardwareProfile.preset("RTX_4090").name == "rtx4090"
    assert HardwareProfile.preset("a100-80g").device_memory == 80 * GiB
    assert HardwareProfile.preset("h100-80g").matmul_flops["bfloat16"] > HardwareProfile.preset("a100-80g").matmul_flops["bfloat16"]


@pytest.mark.parametrize("device_name,preset", [
    ("NVIDIA H100 80GB HBM3", "h100-80g"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80g"),
    ("NVIDIA A100-PCIE-40GB", "a100-40g"), ("Tesla V100-SXM2-32GB", "v100-32g"), ("NVIDIA L4", "l4"),
    ("Tesla T4", "t4"), ("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA GeForce RTX 3090 Ti", "rtx3090"),
    # no preset's whole word: estimates, not another card's figures
    ("NVIDIA L40S", None), ("NVIDIA GH200 480GB", None), ("NVIDIA RTX A6000", None),
])
def test_a_cuda_device_name_is_read_word_by_word(device_name, preset):
    from hf_elixir.hardware import ESTIMATE, _match_preset

    prof = _match_preset(device_name)
    if preset is None:
        assert set(prof.sources.values()) == {ESTIMATE}
    else:
        assert prof.name == preset and ESTIMATE not in {prof.sources["matmul_flops"], prof.sources["device_memory"]}


def test_unknown_preset_lists_the_choices():
    with pytest.raises(HardwareError, match="rtx4090"):
        HardwareProfile.preset("tpu-v9")


@pytest.mark.parametrize("text,expected", [
    ("24 GB", 24 * GB), ("24GiB", 24 * GiB), ("24000MB", 24000 * 10**6), ("80G", 80 * GiB),
    ("1.5TiB", int(1.5 * 2**40)), (1024, 1024), ("512 MiB", 512 * 2**20),
])
def test_parse_memory_accepts_common_spellings(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["lots", "24 GX", "", "GB", "-3GB", "0"])
def test_parse_memory_rejects_nonsense_with_advice(text):
    with pytest.raises(HardwareError, match="GiB|positive"):
        parse_memory(text)


def test_json_round_trip_and_cluster_shape(tmp_path):
    p = HardwareProfile.preset("h100-80g").with_cluster(gpus_per_node=8, nodes=2)
    assert p.world_size == 16
    assert p.collective_rate(16) < p.collective_rate(8)  # crossing nodes is slower
    path = tmp_path / "hw.json"
    p.to_json(path)
    q = HardwareProfile.from_json(path)
    assert q == p
    with pytest.raises(HardwareError):
        HardwareProfile.from_json('{"name": "x", "warp_drive": 1}')


def test_detect_and_calibrate_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ELIXIR_CACHE", str(tmp_path))
    det = HardwareProfile.detect()
    assert det.device_type in ("cpu", "cuda") and det.device_memory > 0
    assert det.sources["device_memory"] == "measured"
    cal = calibrate_machine(quick=True)
    for f in ("h2d_bandwidth", "d2h_bandwidth", "matmul_flops", "cpu_adam_throughput", "device_adam_throughput"):
        assert cal.sources[f] == "measured"
    assert cal.h2d_bandwidth > 1e6 and cal.cpu_adam_throughput > 1e5
    assert cal.is_current()  # stamped with the revision of the routines it timed
    assert cal.calibration_quick and "quick (less accurate" in cal.describe()
    assert cal.matmul_flops["float32"] > 1e6
    figs = cal.compute_figures(1)
    widths = [w for w, _ in figs.efficiency_curve]
    assert widths == sorted(widths) and len(widths) >= 2
    assert all(0.2 < r < 5.0 for _, r in figs.efficiency_curve)
    for sharing in cal.compute.values():  # the post-backward sequence, alone and on two ranks
        assert sharing["update_rate"] > 1e5
    if Path("/proc/stat").exists():  # what the hypervisor took while it measured
        assert 0.0 <= cal.calibration_steal <= 1.0
    if not torch.cuda.is_available() and (os.cpu_count() or 1) <= 2:  # the pair filled every core
        assert set(cal.comm_overlap) == {"gather", "reduce"} and cal.sources["comm_overlap"] == "measured"
        assert all(0.0 <= v <= 1.0 for v in cal.comm_overlap.values())
        assert "gather hidden behind compute" in cal.describe()
    else:  # idle cores would have taken the collectives: nothing measured, the planner's rule
        assert cal.comm_overlap == {}
    cached = list(tmp_path.glob("hardware-*.json"))
    assert len(cached) == 1
    again = HardwareProfile.detect()  # uses the cached calibration
    assert again == cal


def test_an_unreadable_calibration_cache_is_reported_not_silently_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ELIXIR_CACHE", str(tmp_path))
    from hf_elixir.hardware import cache_path

    cache_path().write_text('{"name": "x", "warp_drive": 1}')
    with pytest.warns(UserWarning, match="hf-elixir calibrate"):
        hw = HardwareProfile.detect()
    assert hw.name == "cpu" or hw.device_type == "cuda"  # the preset, as the warning says
    assert cache_path().read_text() == '{"name": "x", "warp_drive": 1}'  # the file is left alone


def test_a_calibration_by_an_older_hf_elixir_is_used_with_a_warning_to_calibrate_again(tmp_path, monkeypatch):
    """A cache written before the timed routines changed (no revision, or another one) still
    gives this machine's figures, not a preset's, and the warning says how to refresh them."""
    from hf_elixir.hardware import CALIBRATION_REVISION, cache_path

    monkeypatch.setenv("HF_ELIXIR_CACHE", str(tmp_path))
    data = json.loads(CALIBRATION.read_text())
    for old in ({k: v for k, v in data.items() if k != "calibration_revision"},
                {**data, "calibration_revision": CALIBRATION_REVISION + 1}):
        cache_path().write_text(json.dumps(old))
        with pytest.warns(UserWarning, match=r"another hf_elixir .*Run `hf-elixir calibrate`"):
            hw = HardwareProfile.detect()
        assert hw.cpu_adam_throughput == data["cpu_adam_throughput"] and not hw.is_current()
        assert json.loads(cache_path().read_text()) == old  # the file is left alone
    cache_path().write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HardwareProfile.detect().is_current()


def test_the_demo_calibrates_again_only_when_the_cache_is_missing_or_stale(tmp_path, monkeypatch):
    """``hf-elixir demo`` measures the machine when nothing is cached or the cache timed
    another revision's routines, and leaves a current calibration alone."""
    from hf_elixir.cli import demo
    from hf_elixir.hardware import cache_path

    monkeypatch.setenv("HF_ELIXIR_CACHE", str(tmp_path))
    data = json.loads(CALIBRATION.read_text())
    measured = []

    def calibrate(quick=False):  # what calibrate_machine leaves behind, without minutes of measuring
        measured.append(quick)
        cache_path().write_text(json.dumps(dict(data, calibration_quick=quick)))

    monkeypatch.setattr(demo, "calibrate_machine", calibrate)
    logged = []
    demo.ensure_calibration(log=lambda *a, **k: logged.append(a[0]))
    assert measured == [False] and "once" in logged[0]
    demo.ensure_calibration(log=lambda *a, **k: logged.append(a[0]))
    demo.ensure_calibration(quick=True, log=lambda *a, **k: logged.append(a[0]))
    assert measured == [False]  # current: left alone, and a full one serves a --fast demo too
    cache_path().write_text(json.dumps({k: v for k, v in data.items() if k != "calibration_revision"}))
    demo.ensure_calibration(log=lambda *a, **k: logged.append(a[0]))
    assert measured == [False, False] and "another hf_elixir" in logged[-2]


def test_the_fast_demo_calibrates_quickly_and_the_full_demo_measures_again_over_it(tmp_path, monkeypatch):
    """``hf-elixir demo --fast`` calibrates with quick sizes (seconds, not a minute) and the
    profile says so; a quick calibration serves the next fast demo, and the full demo
    calibrates again at full size."""
    from hf_elixir.cli import demo
    from hf_elixir.hardware import cache_path

    monkeypatch.setenv("HF_ELIXIR_CACHE", str(tmp_path))
    data = json.loads(CALIBRATION.read_text())
    measured = []

    def calibrate(quick=False):
        measured.append(quick)
        cache_path().write_text(json.dumps(dict(data, calibration_quick=quick)))

    monkeypatch.setattr(demo, "calibrate_machine", calibrate)
    logged = []
    demo.ensure_calibration(quick=True, log=lambda *a, **k: logged.append(a[0]))
    assert measured == [True] and "once" in logged[0] and "quickly" in logged[0]
    assert HardwareProfile.cached().calibration_quick
    demo.ensure_calibration(quick=True, log=lambda *a, **k: logged.append(a[0]))
    assert measured == [True]
    demo.ensure_calibration(log=lambda *a, **k: logged.append(a[0]))
    assert measured == [True, False] and "at full size" in logged[-2]
    assert not HardwareProfile.cached().calibration_quick


def test_steal_meter_reads_the_share_the_hypervisor_took(tmp_path, monkeypatch):
    """The share of all CPU time counted as stolen (the eighth field of /proc/stat's cpu line)
    between the meter's start and now; None where the kernel does not count it. A
    calibration made under steal says so."""
    from hf_elixir.measure import steal

    stat = tmp_path / "stat"
    monkeypatch.setattr(steal, "_STAT", stat)
    stat.write_text("cpu  100 0 50 800 10 0 5 35 7 0\ncpu0 50 0 25 400 5 0 2 18 0 0\n")
    meter = steal.StealMeter()
    # +300 user, +100 system, +200 idle, +400 steal (guest time is inside user): 40% stolen
    stat.write_text("cpu  400 0 150 1000 10 0 5 435 99 0\n")
    assert meter.share() == pytest.approx(0.4)
    meter.restart()
    assert meter.share() == 0.0
    stat.write_text("cpu  1 2 3 4\n")  # a kernel without the steal field
    assert steal.cpu_times() is None and meter.share() is None
    monkeypatch.setattr(steal, "_STAT", tmp_path / "missing")
    assert steal.StealMeter().share() is None

    hw = HardwareProfile.preset("cpu")
    assert "stolen" not in hw.describe()
    assert "CPU stolen while calibrating  5%\n" in replace(hw, calibration_steal=0.05).describe() + "\n"
    assert "32% (a busy host: calibrate again when it is quiet)" in replace(hw, calibration_steal=0.32).describe()


class _SleepingCollectives:
    """Collectives that take 40 ms: a gather that sleeps in a thread of its own when left
    running (so it hides completely), a reduction that sleeps on the caller's thread even
    when asked to run beside (so nothing hides)."""

    world_size = 1
    reduce_needs_scratch = False

    def all_gather(self, full, shard, async_op=False):
        import threading

        from hf_elixir.runtime.comm import Work

        if not async_op:
            time.sleep(0.04)
            return Work()
        t = threading.Thread(target=time.sleep, args=(0.04,))
        t.start()
        return Work(type("Joined", (), {"wait": lambda self: t.join()})())

    def reduce_scatter_accumulate(self, target, full, scratch=None, async_op=False):
        from hf_elixir.runtime.comm import Work

        time.sleep(0.04)
        return Work()


class _SleepingBlock(torch.nn.Module):
    """A block whose "compute" is a 60 ms sleep. The test checks what ``comm_overlap`` makes
    of collectives that hide wholly or not at all; a real block takes a few ms, and on a busy
    machine (the suite runs two files at once) its time varied more between the paired runs
    than the share's margin (a hidden gather once measured 0.62). A sleep takes its time
    whatever else runs, and longer than a collective, so all of one could hide behind it."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()

    def forward(self, y):
        time.sleep(0.06)
        return y


def _overlap_of_sleepers(rank: int, world_size: int) -> dict:
    import hf_elixir.measure.calibrate as calibrate

    calibrate._Block = _SleepingBlock  # a forked rank of its own: nothing else sees it
    return calibrate.comm_overlap(_SleepingCollectives(), quick=True)


def test_the_hidden_share_of_collectives_is_what_running_beside_compute_saved():
    """``calibrate.comm_overlap`` measures the share of a collective's time that hides
    behind compute: all of a collective that runs elsewhere, none of one that occupies the
    rank's own thread."""
    from harness import run_distributed

    got = run_distributed(_overlap_of_sleepers, 1)[0]
    assert got["gather"] > 0.85, got
    assert got["reduce"] < 0.15, got
