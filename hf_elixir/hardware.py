"""HardwareProfile: the figures the cost model needs about one kind of machine.

A profile is either a *preset* (figures from datasheets, published measurements or
estimates; each figure says which in ``sources``), *detected* (the local device's name and
memory, other figures from the matching preset or a cached calibration) or *calibrated*
(every figure measured here by ``calibrate()``, cached as JSON under the user's cache
directory). docs/hardware.md tabulates the presets and their sources.

Units: bytes, bytes/second, FLOP/s, elements/second.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

GiB = 2**30
GB = 10**9

DATASHEET, MEASURED, PUBLISHED, ESTIMATE = "datasheet", "measured", "published measurement", "estimate"
#: share of CPU time stolen by the hypervisor during a calibration above which it says so:
#: this 2-core VM measured 1-4% when quiet, and 30% in a spell that ran steps 1.8x slower
STEAL_WARNING = 0.10


class HardwareError(ValueError):
    """An unknown preset, an unparsable memory size or an unreadable calibration file."""


@dataclass
class HardwareProfile:
    """One node type: per-device figures plus how many devices and nodes there are.

    Attributes:
        name: preset key or device name.
        device_type: "cuda" or "cpu" (CPU: the compute device and offload target are both host memory).
        device_memory: bytes of memory per device.
        gpus_per_node, nodes: the cluster shape (world size = gpus_per_node * nodes).
        h2d_bandwidth, d2h_bandwidth: host<->device copy bandwidth per device (pinned memory), B/s.
        collective_bandwidth: intra-node all-gather/reduce-scatter *bus* bandwidth per device, B/s.
        inter_node_bandwidth: per-device network bandwidth between nodes, B/s.
        collective_latency: fixed cost per collective call, s.
        matmul_flops: peak dense matmul rate by dtype ("float32", "bfloat16", "float16"), FLOP/s.
        matmul_efficiency: fraction of ``matmul_flops`` a training step achieves (1.0 when the
            rate was measured with realistic sizes).
        device_memory_bandwidth: device memory bandwidth, B/s (device-side copies).
        device_adam_throughput: fused AdamW on the device, parameters/s.
        cpu_adam_throughput: vectorised CPU AdamW, parameters/s for the whole host (shared by
            the node's ranks).
        cpu_memory: host memory per node, bytes.
        context_bytes: device memory the runtime cannot use (CUDA context, NCCL buffers).
        reduce_bandwidth: bus bandwidth of the runtime's gradient reduction, B/s (0: the same
            as ``collective_bandwidth``; on gloo the runtime reduces with another algorithm).
        compute: measured per-operator figures (``hf_elixir.calibrate.ComputeFigures`` as
            dicts), ``"shared"`` for a rank sharing its node, ``"whole"`` for a lone process;
            empty for presets, which derive them from the datasheet figures.
        calibration_steal: share of the CPU time a hypervisor took from this (virtual)
            machine while it was calibrated (``hf_elixir.steal``); None for presets or where
            the kernel does not count it. Figures measured under steal price plans slower
            than the machine runs when its host is quiet.
        comm_overlap: on a CPU whose cores all run ranks, the share of a collective's time
            that still hides behind compute running beside it, by kind (``"gather"``: the
            runtime's chunk gather, ``"reduce"``: its gradient reduction); measured by
            ``calibrate()``, empty (nothing hides) for presets. Idle cores take the rest.
        sources: field name -> datasheet / published measurement / estimate / measured.
    """

    name: str
    device_type: str = "cuda"
    device_memory: int = 80 * GiB
    gpus_per_node: int = 1
    nodes: int = 1
    h2d_bandwidth: float = 25e9
    d2h_bandwidth: float = 25e9
    collective_bandwidth: float = 100e9
    inter_node_bandwidth: float = 12.5e9
    collective_latency: float = 30e-6
    matmul_flops: dict[str, float] = field(default_factory=lambda: {"float32": 20e12, "bfloat16": 300e12, "float16": 300e12})
    matmul_efficiency: float = 0.5
    device_memory_bandwidth: float = 1.5e12
    device_adam_throughput: float = 20e9
    cpu_adam_throughput: float = 1.5e9
    cpu_memory: int = 512 * GiB
    context_bytes: int = 512 * 2**20
    reduce_bandwidth: float = 0.0
    compute: dict[str, dict] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    calibration_steal: float | None = None
    comm_overlap: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def matmul_rate(self, dtype: str) -> float:
        """Achievable dense matmul FLOP/s in ``dtype``."""
        from hf_elixir.plan.plan import canonical_dtype

        return self.matmul_flops[canonical_dtype(dtype)] * self.matmul_efficiency

    def compute_figures(self, ranks_per_node: int = 1):
        """The per-operator figures of one rank (``hf_elixir.calibrate.ComputeFigures``).

        Measured ones when this profile was calibrated; otherwise derived from the datasheet
        figures: matmuls at ``matmul_rate`` whatever their size, other operators' reads and
        writes at 80% of the memory bandwidth, and a typical dispatch cost per call.
        """
        from hf_elixir.calibrate import ComputeFigures, sharing

        key = sharing(ranks_per_node)
        data = self.compute.get(key) or next(iter(self.compute.values()), None)
        if data:
            return ComputeFigures.from_dict(data)
        return ComputeFigures(
            matmul_curve={k: [[1.0, v * self.matmul_efficiency]] for k, v in self.matmul_flops.items() if v > 0},
            read_bandwidth=0.8 * self.device_memory_bandwidth,
            strided_bandwidth=0.3 * self.device_memory_bandwidth,
            special_rate=0.2 * self.device_memory_bandwidth / 4,
            write_curve=[[1.0, 0.8 * self.device_memory_bandwidth]],
            op_overhead=10e-6 if self.device_type == "cuda" else 5e-6,
            adam_rate=self.device_adam_throughput, threads=1,
        )

    def reduce_rate(self, world_size: int | None = None) -> float:
        """Bus bandwidth of the runtime's gradient reduction across ``world_size`` ranks."""
        rate = self.collective_rate(world_size)
        return min(rate, self.reduce_bandwidth) if self.reduce_bandwidth > 0 else rate

    def collective_rate(self, world_size: int | None = None) -> float:
        """Bus bandwidth of a collective spanning ``world_size`` ranks."""
        ws = self.world_size if world_size is None else world_size
        if ws > self.gpus_per_node and self.nodes > 1:
            return min(self.collective_bandwidth, self.inter_node_bandwidth)
        return self.collective_bandwidth

    def with_cluster(self, gpus_per_node: int | None = None, nodes: int | None = None,
                     device_memory: int | None = None) -> "HardwareProfile":
        """A copy with another cluster shape or device memory."""
        out = replace(self, sources=dict(self.sources), matmul_flops=dict(self.matmul_flops),
                      compute={k: dict(v) for k, v in self.compute.items()},
                      comm_overlap=dict(self.comm_overlap))
        if gpus_per_node is not None:
            out.gpus_per_node = int(gpus_per_node)
        if nodes is not None:
            out.nodes = int(nodes)
        if device_memory is not None:
            out.device_memory = int(device_memory)
            out.sources["device_memory"] = "user"
        return out

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str) -> "HardwareProfile":
        """A preset by name (case-insensitive; ``-``/``_`` interchangeable)."""
        key = name.lower().replace("_", "-").strip()
        key = _PRESET_ALIASES.get(key, key)
        if key not in PRESETS:
            raise HardwareError(
                f"unknown hardware preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}"
            )
        p = PRESETS[key]
        return replace(p, sources=dict(p.sources), matmul_flops=dict(p.matmul_flops))

    @classmethod
    def presets(cls) -> list[str]:
        return sorted(PRESETS)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HardwareProfile":
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise HardwareError(f"unknown hardware profile fields {sorted(unknown)}")
        return cls(**data)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "HardwareProfile":
        text = str(text_or_path)
        try:
            if not text.lstrip().startswith("{"):
                text = Path(text_or_path).read_text()
            return cls.from_dict(json.loads(text))
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise HardwareError(f"cannot read a hardware profile from {str(text_or_path)[:80]!r}: {e}") from e

    # ------------------------------------------------------------------ local machine
    @classmethod
    def detect(cls, use_cache: bool = True) -> "HardwareProfile":
        """The local machine: CUDA device 0 if present, else the CPU.

        Name, memory and device count are read from the device; the other figures come from a
        cached calibration of this machine if there is one (see ``calibrate``), else from the
        matching preset.
        """
        if use_cache:
            cached = cls.cached()
            if cached is not None:
                return cached
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            base = _match_preset(props.name)
            prof = base.with_cluster(gpus_per_node=torch.cuda.device_count(), nodes=1,
                                     device_memory=int(props.total_memory))
            prof.name = props.name
            prof.sources["device_memory"] = MEASURED
            prof.cpu_memory = _host_memory()
            prof.sources["cpu_memory"] = MEASURED
            return prof
        prof = cls.preset("cpu")
        prof.device_memory = prof.cpu_memory = _host_memory()
        prof.sources["device_memory"] = prof.sources["cpu_memory"] = MEASURED
        return prof

    @classmethod
    def cached(cls) -> "HardwareProfile | None":
        """The cached calibration of this machine, or None."""
        path = cache_path()
        if not path.exists():
            return None
        try:
            return cls.from_json(path)
        except HardwareError as e:
            warnings.warn(f"hf_elixir: the calibration cached in {path} cannot be read ({e}); planning with "
                          "preset figures instead. Run `hf-elixir calibrate` to measure this machine again",
                          stacklevel=2)
            return None

    @classmethod
    def calibrate(cls, output: str | Path | None = None, quick: bool = False,
                  save: bool = True) -> "HardwareProfile":
        """Measure every figure on this machine (under a minute) and cache it as JSON.

        ``quick`` uses smaller sizes (a few seconds; less accurate) and is meant for tests.
        """
        prof = calibrate_local(quick=quick)
        if save:
            prof.to_json(output or cache_path())
        return prof

    def describe(self) -> str:
        rows = [
            ("device", f"{self.name} ({self.device_type})"),
            ("device memory", format_bytes(self.device_memory)),
            ("devices", f"{self.gpus_per_node} per node x {self.nodes} node(s)"),
            ("host->device", f"{self.h2d_bandwidth / 1e9:.1f} GB/s"),
            ("device->host", f"{self.d2h_bandwidth / 1e9:.1f} GB/s"),
            ("collective (intra-node)", f"{self.collective_bandwidth / 1e9:.1f} GB/s"),
            ("inter-node", f"{self.inter_node_bandwidth / 1e9:.1f} GB/s"),
            *[(f"{kind} hidden behind compute", f"{share:.0%} (every core busy)")
              for kind, share in self.comm_overlap.items()],
            *[(f"matmul {k}", f"{v / 1e12:.2f} TFLOP/s") for k, v in self.matmul_flops.items()],
            ("matmul efficiency", f"{self.matmul_efficiency:.2f}"),
            ("device AdamW", f"{self.device_adam_throughput / 1e9:.2f} G params/s"),
            ("CPU AdamW", f"{self.cpu_adam_throughput / 1e9:.2f} G params/s"),
            ("CPU memory", format_bytes(self.cpu_memory)),
        ]
        if self.calibration_steal is not None:
            note = " (a busy host: calibrate again when it is quiet)" if self.calibration_steal >= STEAL_WARNING else ""
            rows.append(("CPU stolen while calibrating", f"{self.calibration_steal:.0%}{note}"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------------- memory strings
_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def parse_memory(text: str | int | float) -> int:
    """Bytes from "24GiB", "24 GB", "24000MB", "80G" (G/GiB binary, GB decimal) or a number.

    Raises HardwareError with the accepted forms when the string is not a size.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise HardwareError(f"memory size must be positive, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise HardwareError(
            f"cannot read memory size {text!r}: write a number and a unit, e.g. '24GiB', "
            "'24 GB', '24000MB' or '80G' (GiB/MiB/G are powers of 1024, GB/MB powers of 1000)"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise HardwareError(f"memory size must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------- presets
def _p(name, memory, h2d, coll, flops32, flops16, bf16, mem_bw, dev_adam, cpu_adam,
       inter_node_bandwidth=25e9, sources=None, **kw) -> HardwareProfile:
    return HardwareProfile(
        name=name, device_type="cuda", device_memory=memory, gpus_per_node=1, nodes=1,
        h2d_bandwidth=h2d, d2h_bandwidth=h2d, collective_bandwidth=coll, inter_node_bandwidth=inter_node_bandwidth,
        matmul_flops={"float32": flops32, "float16": flops16, "bfloat16": bf16},
        device_memory_bandwidth=mem_bw, device_adam_throughput=dev_adam,
        cpu_adam_throughput=cpu_adam, sources=sources or {}, **kw,
    )


def _src(**overrides: str) -> dict[str, str]:
    base = {
        "device_memory": DATASHEET, "matmul_flops": DATASHEET, "device_memory_bandwidth": DATASHEET,
        "h2d_bandwidth": PUBLISHED, "d2h_bandwidth": PUBLISHED, "collective_bandwidth": PUBLISHED,
        "inter_node_bandwidth": ESTIMATE, "collective_latency": ESTIMATE,
        "matmul_efficiency": ESTIMATE, "device_adam_throughput": ESTIMATE,
        "cpu_adam_throughput": ESTIMATE, "cpu_memory": ESTIMATE, "context_bytes": ESTIMATE,
    }
    base.update(overrides)
    return base


# Device AdamW is memory-bound: ~32 bytes move per parameter (fp32 master, two moments read
# and written, fp32 gradient read, compute-dtype copy written), so the estimate is
# 0.6 * memory bandwidth / 32 B. CPU AdamW: ZeRO-Offload's CPU-Adam on a 2-socket server
# updates ~1e9 parameters in ~0.3-0.5 s; desktop hosts about half that.
def _adam(mem_bw: float) -> float:
    return 0.6 * mem_bw / 32


PRESETS: dict[str, HardwareProfile] = {
    "a100-40g": _p("a100-40g", 40 * GiB, 24e9, 230e9, 19.5e12, 312e12, 312e12, 1555e9, _adam(1555e9), 2.5e9,
                   cpu_memory=1024 * GiB, sources=_src()),
    "a100-80g": _p("a100-80g", 80 * GiB, 24e9, 230e9, 19.5e12, 312e12, 312e12, 2039e9, _adam(2039e9), 2.5e9,
                   cpu_memory=1024 * GiB, sources=_src()),
    "h100-80g": _p("h100-80g", 80 * GiB, 50e9, 360e9, 67e12, 989e12, 989e12, 3350e9, _adam(3350e9), 3e9,
                   cpu_memory=2048 * GiB, inter_node_bandwidth=50e9, sources=_src()),
    "h200": _p("h200", 141 * GB, 50e9, 360e9, 67e12, 989e12, 989e12, 4800e9, _adam(4800e9), 3e9,
               cpu_memory=2048 * GiB, inter_node_bandwidth=50e9, sources=_src()),
    "l4": _p("l4", 24 * GB, 24e9, 20e9, 30.3e12, 121e12, 121e12, 300e9, _adam(300e9), 1.5e9,
             cpu_memory=192 * GiB, sources=_src(collective_bandwidth=ESTIMATE)),
    "t4": _p("t4", 16 * GB, 12e9, 10e9, 8.1e12, 65e12, 8.1e12, 320e9, _adam(320e9), 1e9,
             cpu_memory=128 * GiB, sources=_src(collective_bandwidth=ESTIMATE)),
    "v100-32g": _p("v100-32g", 32 * GiB, 12e9, 130e9, 15.7e12, 125e12, 15.7e12, 900e9, _adam(900e9), 1.5e9,
                   cpu_memory=512 * GiB, sources=_src()),
    "rtx3090": _p("rtx3090", 24 * GiB, 24e9, 12e9, 35.6e12, 71e12, 71e12, 936e9, _adam(936e9), 1e9,
                  cpu_memory=128 * GiB, sources=_src(collective_bandwidth=ESTIMATE)),
    "rtx4090": _p("rtx4090", 24 * GiB, 24e9, 12e9, 82.6e12, 165e12, 165e12, 1008e9, _adam(1008e9), 1e9,
                  cpu_memory=128 * GiB, sources=_src(collective_bandwidth=ESTIMATE)),
    "cpu": HardwareProfile(
        name="cpu", device_type="cpu", device_memory=64 * GiB, gpus_per_node=1, nodes=1,
        h2d_bandwidth=10e9, d2h_bandwidth=10e9, collective_bandwidth=2e9,
        inter_node_bandwidth=1e9, collective_latency=200e-6,
        matmul_flops={"float32": 200e9, "bfloat16": 50e9, "float16": 20e9},
        matmul_efficiency=0.7, device_memory_bandwidth=10e9, device_adam_throughput=1e9,
        cpu_adam_throughput=1e9, cpu_memory=64 * GiB, context_bytes=0,
        sources={k: ESTIMATE for k in (
            "device_memory", "h2d_bandwidth", "d2h_bandwidth", "collective_bandwidth",
            "inter_node_bandwidth", "collective_latency", "matmul_flops", "matmul_efficiency",
            "device_memory_bandwidth", "device_adam_throughput", "cpu_adam_throughput",
            "cpu_memory", "context_bytes")},
    ),
}

_PRESET_ALIASES = {
    "a100": "a100-40g", "a100-40gb": "a100-40g", "a100-80gb": "a100-80g", "h100": "h100-80g",
    "h100-80gb": "h100-80g", "h200-141g": "h200", "v100": "v100-32g", "v100-32gb": "v100-32g",
    "rtx-3090": "rtx3090", "rtx-4090": "rtx4090", "3090": "rtx3090", "4090": "rtx4090",
}


def _match_preset(device_name: str) -> HardwareProfile:
    """The preset closest to a CUDA device name (e.g. "NVIDIA H100 80GB HBM3")."""
    n = device_name.lower()
    table = [("h200", "h200"), ("h100", "h100-80g"), ("a100", "a100-80g" if "80" in n else "a100-40g"),
             ("v100", "v100-32g"), ("4090", "rtx4090"), ("3090", "rtx3090"), ("l4", "l4"), ("t4", "t4")]
    for needle, key in table:
        if needle in n:
            return HardwareProfile.preset(key)
    prof = HardwareProfile.preset("a100-40g")
    prof.sources = {k: ESTIMATE for k in prof.sources}
    return prof


def _host_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 64 * GiB


def cache_path() -> Path:
    """Where calibrations are cached: $HF_ELIXIR_CACHE or $XDG_CACHE_HOME/hf_elixir, per host."""
    root = os.environ.get("HF_ELIXIR_CACHE")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hf_elixir")
    return Path(root) / f"hardware-{socket.gethostname()}.json"


# ---------------------------------------------------------------------- calibration
def calibrate_local(quick: bool = False) -> HardwareProfile:
    """Measure this machine. Every figure it sets is marked "measured" in ``sources``.

    What the cost model prices a step with (matmul rate by size, element-wise bandwidth,
    cost per operator, a transformer block's forward and backward, the runtime's AdamW and
    collectives) is measured by ``hf_elixir.calibrate``; see its docstring.
    """
    from hf_elixir import calibrate as cal
    from hf_elixir.steal import StealMeter

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
    if prof.calibration_steal is not None and prof.calibration_steal >= STEAL_WARNING:
        warnings.warn(f"hf_elixir calibrate: the hypervisor took {prof.calibration_steal:.0%} of this machine's CPU "
                      "time while it was measured, so its figures are slower than the machine is when its host "
                      "is quiet; calibrate again later (hf-elixir calibrate)", stacklevel=2)
    return prof
