"""Hardware profiles: presets with sources, memory strings, JSON, detect and calibrate."""

from __future__ import annotations

import pytest

from hf_elixir.hardware import GB, GiB, PRESETS, HardwareError, HardwareProfile, parse_memory

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
    cal = HardwareProfile.calibrate(quick=True)
    for f in ("h2d_bandwidth", "d2h_bandwidth", "matmul_flops", "cpu_adam_throughput", "device_adam_throughput"):
        assert cal.sources[f] == "measured"
    assert cal.h2d_bandwidth > 1e6 and cal.cpu_adam_throughput > 1e5
    assert cal.matmul_flops["float32"] > 1e6
    figs = cal.compute_figures(1)
    widths = [w for w, _ in figs.efficiency_curve]
    assert widths == sorted(widths) and len(widths) >= 2
    assert all(0.2 < r < 5.0 for _, r in figs.efficiency_curve)
    cached = list(tmp_path.glob("hardware-*.json"))
    assert len(cached) == 1
    again = HardwareProfile.detect()  # uses the cached calibration
    assert again == cal
