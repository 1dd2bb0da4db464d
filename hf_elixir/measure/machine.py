"""Calibrate this machine: measure every figure a ``HardwareProfile`` holds, and cache it.

The measuring lives here, above the runtime, because it times the runtime's own AdamW and
collectives; ``hf_elixir.hardware`` keeps only the data it produces.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from hf_elixir.hardware import CALIBRATION_REVISION, MEASURED, STEAL_WARNING, HardwareProfile, cache_path
from hf_elixir.measure import calibrate as cal
from hf_elixir.measure.host_rate import host_update_rate
from hf_elixir.measure.steal import StealMeter
from hf_elixir.runtime.threads import host_threads


def calibrate_machine(output: str | Path | None = None, quick: bool = False, save: bool = True) -> HardwareProfile:
    """Measure every figure on this machine (under a minute) and cache it as JSON where
    ``HardwareProfile.detect()`` finds it (``output`` to write elsewhere).

    ``quick`` uses smaller sizes (a few seconds; less accurate) and is meant for tests.
    """
    prof = measure_machine(quick=quick)
    if save:
        prof.to_json(output or cache_path())
    return prof


def measure_machine(quick: bool = False) -> HardwareProfile:
    """Measure this machine. Every figure it sets is marked "measured" in ``sources``.

    What the cost model prices a step with (matmul rate by size, element-wise bandwidth,
    cost per operator, a transformer block's forward and backward, the runtime's AdamW and
    collectives) is measured by ``hf_elixir.measure.calibrate``; see its docstring.
    """
    steal = StealMeter()
    cuda = torch.cuda.is_available()
    prof = HardwareProfile.detect(use_cache=False)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else None
    src = dict(prof.sources)
    copy_elems = (4 if quick else 64) * 2**20 // 4  # fp32 elements

    # host <-> device (on CPU a host memory copy; the runtime makes none there)
    host = torch.empty(copy_elems, dtype=torch.float32, pin_memory=cuda)
    devbuf = torch.empty(copy_elems, dtype=torch.float32, device=dev)
    nbytes = copy_elems * 4
    prof.h2d_bandwidth = nbytes / cal.best_time(lambda: devbuf.copy_(host, non_blocking=cuda), sync=sync)
    prof.d2h_bandwidth = nbytes / cal.best_time(lambda: host.copy_(devbuf, non_blocking=cuda), sync=sync)
    other = torch.empty_like(devbuf)
    prof.device_memory_bandwidth = 2 * nbytes / cal.best_time(lambda: other.copy_(devbuf), sync=sync)
    del host, devbuf, other

    # one process with every core (world size 1) ...
    dtypes = ("float32", "bfloat16", "float16") if cuda else ("float32",)
    whole = cal.measure_compute(dev, dtypes=dtypes, quick=quick)
    prof.compute = {"whole": asdict(whole)}
    prof.matmul_flops = {d: max(r for _, r in whole.matmul_curve[d]) for d in dtypes}
    if not cuda:  # the CPU's half-precision rates, from one square matmul each (not priced per size)
        n = 256 if quick else 512
        for name, dt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            try:
                a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
                prof.matmul_flops[name] = 2 * n**3 / cal.best_time(lambda: a @ b, repeat=2)
            except RuntimeError:
                prof.matmul_flops[name] = 0.0
    prof.matmul_efficiency = 1.0
    prof.device_adam_throughput = whole.adam_rate
    if cuda:  # the host's whole share of an offloaded element's step, as the runtime runs it
        prof.cpu_adam_throughput = host_update_rate((1 if quick else 8) * 2**20, host_threads())
    else:
        prof.cpu_adam_throughput = cal.adam_rate(torch.device("cpu"), (1 if quick else 8) * 2**20)

    # ... and two at once: per-rank compute on a shared CPU, the runtime's collectives
    pair = cal.measure_pair(quick=quick)
    if pair is not None:
        (prof.collective_bandwidth, prof.collective_latency) = pair.gather
        prof.reduce_bandwidth = pair.reduce[0]
        src["collective_bandwidth"] = src["collective_latency"] = src["reduce_bandwidth"] = MEASURED
        if pair.compute:
            prof.compute["shared"] = pair.compute
            if not cuda:  # the host's AdamW rate is what all its ranks achieve together
                prof.cpu_adam_throughput = 2 * pair.compute["adam_rate"]
        if pair.overlap and 2 >= (os.cpu_count() or 1):
            # measured with every core running a rank; with idle cores left over the pair
            # would measure those instead, and the planner keeps its rule (Links.of)
            prof.comm_overlap = dict(pair.overlap)
            src["comm_overlap"] = MEASURED

    for k in ("h2d_bandwidth", "d2h_bandwidth", "device_memory_bandwidth", "matmul_flops",
              "matmul_efficiency", "cpu_adam_throughput", "device_adam_throughput", "compute"):
        src[k] = MEASURED
    prof.sources = src
    prof.name = prof.name + " (calibrated)" if "calibrated" not in prof.name else prof.name
    prof.calibration_steal = steal.share()
    prof.calibration_revision = CALIBRATION_REVISION
    prof.calibration_quick = quick
    if prof.calibration_steal is not None and prof.calibration_steal >= STEAL_WARNING:
        warnings.warn(f"hf_elixir calibrate: the hypervisor took {prof.calibration_steal:.0%} of this machine's CPU "
                      "time while it was measured, so its figures are slower than the machine is when its host "
                      "is quiet; calibrate again later (hf-elixir calibrate)", stacklevel=2)
    return prof
