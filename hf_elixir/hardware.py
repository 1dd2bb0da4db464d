"""HardwareProfile: the figures the cost model needs about one kind of machine.

A profile is either a *preset* (figures from datasheets, published measurements or
estimates; each figure says which in ``sources``), *detected* (the local device's name and
memory, other figures from the matching preset or a cached calibration) or *calibrated*
(every figure measured here by ``calibrate()``, cached as JSON under the user's cache
directory). docs/planning.md tabulates the presets and their sources.

Units: bytes, bytes/second, FLOP/s, elements/second.
"""

from __future__ import annotations

import json
import math
import os
import socket
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hf_elixir.vocab import GB, GiB, HfElixirError, canonical_dtype, format_bytes, parse_bytes


DATASHEET, MEASURED, PUBLISHED, ESTIMATE = "datasheet", "measured", "published measurement", "estimate"
#: share of CPU time stolen by the hypervisor during a calibration above which it says so: a
#: quiet shared VM loses a few percent, and a busy spell that slows every figure far more
STEAL_WARNING = 0.10


class HardwareError(HfElixirError, ValueError):
    """An unknown preset, an unparsable memory size or an unreadable calibration file."""


#: the disk tier's bandwidth where none was measured: a PCIe 3.0/4.0 NVMe drive's sustained
#: sequential figures under O_DIRECT, below the datasheets' burst numbers (an estimate)
NVME_READ = 2.0e9
NVME_WRITE = 1.0e9

#: The revision of the routines a calibration times. A calibration prices the runtime's own
#: kernels (the host's update and its copies, the gradient add, the collectives), so one
#: taken before a change that made them faster or slower keeps the old speed: a GPU machine
#: calibrated before the one-pass host update priced offload about twice too slow. Raise it
#: with any such change; ``HardwareProfile.cached`` then tells the user to calibrate again,
#: and ``hf-elixir demo`` does so itself. 2: clipping's scaling of offloaded gradients moved
#: into the host update (``measure/host_rate.py``, timed on GPU machines only, so a CPU
#: machine's figures are the same under both).
CALIBRATION_REVISION = 2


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
        cpu_adam_throughput: the host's update of offloaded optimizer state, parameters/s for
            the whole host (shared by the node's ranks). Calibrated on a GPU machine it is all
            the host does per offloaded parameter in a step (``measure/host_rate.py``);
            presets give a vectorised CPU AdamW's rate.
        cpu_memory: host memory per node the plan may use, bytes (the host-memory budget:
            offloaded state counts against it for all the node's ranks together). Presets give
            the node's memory; ``detect()`` on a GPU machine what the host has available now.
        disk_read_bandwidth, disk_write_bandwidth: sequential bandwidth of the disk tier's
            directory at chunk-sized blocks, B/s, shared by the node's ranks
            (``hf_elixir.measure.disk``; presets: an NVMe estimate).
        disk_free: free bytes the disk tier may use on each node; None: not known, not checked
            (a plan for hardware one does not have, without ``--nvme-size``).
        context_bytes: device memory the runtime cannot use (CUDA context, NCCL buffers).
        reduce_bandwidth: bus bandwidth of the runtime's gradient reduction, B/s (0: the same
            as ``collective_bandwidth``; on gloo the runtime reduces with another algorithm).
        compute: measured per-operator figures (``hf_elixir.measure.calibrate.ComputeFigures`` as
            dicts), ``"shared"`` for a rank sharing its node, ``"whole"`` for a lone process;
            empty for presets, which derive them from the datasheet figures.
        calibration_steal: share of the CPU time a hypervisor took from this (virtual)
            machine while it was calibrated (``hf_elixir.measure.steal``); None for presets or where
            the kernel does not count it. Figures measured under steal price plans slower
            than the machine runs when its host is quiet.
        comm_overlap: on a CPU whose cores all run ranks, the share of a collective's time
            that still hides behind compute running beside it, by kind (``"gather"``: the
            runtime's chunk gather, ``"reduce"``: its gradient reduction); measured by
            ``calibrate()``, empty (nothing hides) for presets. Idle cores take the rest.
        calibration_revision: ``CALIBRATION_REVISION`` of the hf_elixir that measured these
            figures; 0 for presets and for calibrations older than the revisions.
        calibration_quick: measured with ``quick`` sizes (``hf-elixir calibrate --quick``,
            ``hf-elixir demo --fast``): seconds instead of a minute or more, less accurate.
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
    disk_read_bandwidth: float = NVME_READ
    disk_write_bandwidth: float = NVME_WRITE
    disk_free: int | None = None
    context_bytes: int = 512 * 2**20
    reduce_bandwidth: float = 0.0
    compute: dict[str, dict] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    calibration_steal: float | None = None
    comm_overlap: dict[str, float] = field(default_factory=dict)
    calibration_revision: int = 0
    calibration_quick: bool = False

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def matmul_rate(self, dtype: str) -> float:
        """Achievable dense matmul FLOP/s in ``dtype``."""
        return self.matmul_flops[canonical_dtype(dtype)] * self.matmul_efficiency

    def compute_figures(self, ranks_per_node: int = 1):
        """The per-operator figures of one rank (``hf_elixir.measure.calibrate.ComputeFigures``).

        Measured ones when this profile was calibrated; otherwise derived from the datasheet
        figures: matmuls at ``matmul_rate`` whatever their size, other operators' reads and
        writes at 80% of the memory bandwidth, and a typical dispatch cost per call.
        """
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
            # written whole under a temporary name, then renamed: a launch planning on this
            # machine at the same moment reads the old calibration or the new, never half of one
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
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
            prof.cpu_memory = _host_memory_available()
            prof.sources["cpu_memory"] = MEASURED
            return prof
        prof = cls.preset("cpu")
        prof.device_memory = prof.cpu_memory = _host_memory()
        prof.sources["device_memory"] = prof.sources["cpu_memory"] = MEASURED
        return prof

    @classmethod
    def cached(cls, warn_stale: bool = True) -> "HardwareProfile | None":
        """The cached calibration of this machine, or None.

        A calibration by another revision of the timed routines (``is_current``) is still
        returned, since its other figures are this machine's and beat a preset's, with a
        warning (unless ``warn_stale`` is False) that says to calibrate again.
        """
        path = cache_path()
        if not path.exists():
            return None
        try:
            prof = cls.from_json(path)
        except HardwareError as e:
            warnings.warn(f"hf_elixir: the calibration cached in {path} cannot be read ({e}); planning with "
                          "preset figures instead. Run `hf-elixir calibrate` to measure this machine again",
                          stacklevel=2)
            return None
        if warn_stale and not prof.is_current():
            warnings.warn(f"hf_elixir: the calibration cached in {path} timed the routines of another "
                          f"hf_elixir (revision {prof.calibration_revision}, this one {CALIBRATION_REVISION}), "
                          "so the plan may price them at their old speed. Run `hf-elixir calibrate` to "
                          "measure this machine again", stacklevel=2)
        return prof

    def is_current(self) -> bool:
        """Whether this profile was calibrated by this hf_elixir's revision of the timed
        routines (``CALIBRATION_REVISION``)."""
        return self.calibration_revision == CALIBRATION_REVISION

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
        if self.calibration_quick:
            rows.append(("calibration", "quick (less accurate; `hf-elixir calibrate` measures at full size)"))
        if self.calibration_steal is not None:
            note = " (a busy host: calibrate again when it is quiet)" if self.calibration_steal >= STEAL_WARNING else ""
            rows.append(("CPU stolen while calibrating", f"{self.calibration_steal:.0%}{note}"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------------- memory strings
def parse_memory(text: str | int | float, bare_minimum: int = 1) -> int:
    """Bytes from "24GiB", "24 GB", "24000MB", "80G" (G/GiB binary, GB decimal) or a number.

    Raises HardwareError with the accepted forms when the string is not a size, or is NaN,
    infinite, negative, below one byte, or a number without a unit below ``bare_minimum``
    (``vocab.BARE_MINIMUM`` where a person wrote it: a config file, the command line).
    """
    return parse_bytes(text, "memory size", HardwareError, bare_minimum)


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
        "disk_read_bandwidth": ESTIMATE, "disk_write_bandwidth": ESTIMATE,
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
    """The preset of a CUDA device name (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB").

    A word of the name that is a GPU preset's name or alias ("h100", "4090") picks it; whole
    words only: an "NVIDIA L40S" is not an L4, nor a "GH200" an H200. A name with no such word
    gets the a100-40g figures marked as estimates, for a calibration to replace."""
    words = "".join(c if c.isalnum() else " " for c in device_name.lower()).split()
    for word in words:
        key = _PRESET_ALIASES.get(word, word)
        if key == "a100-40g" and "80gb" in words:
            key = "a100-80g"
        if key in PRESETS and key != "cpu":
            return HardwareProfile.preset(key)
    prof = HardwareProfile.preset("a100-40g")
    prof.sources = {k: ESTIMATE for k in prof.sources}
    return prof


def _host_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 64 * GiB


def _host_memory_available() -> int:
    """What the host can give a run now (``MemAvailable``: free memory plus reclaimable
    cache), the default host-memory budget on a GPU machine; the search keeps a margin of it
    (``planner.search.HOST_USABLE``). The whole memory where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(int(line.split()[1]) * 1024, _host_memory())
    except (OSError, ValueError, IndexError):
        pass
    return _host_memory()


def cache_root() -> Path:
    """hf_elixir's cache folder: $HF_ELIXIR_CACHE, or $XDG_CACHE_HOME/hf_elixir."""
    root = os.environ.get("HF_ELIXIR_CACHE")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hf_elixir")
    return Path(root)


def cache_path() -> Path:
    """Where calibrations are cached: in ``cache_root()``, per host."""
    return cache_root() / f"hardware-{socket.gethostname()}.json"


# ---------------------------------------------------------------------- calibration


# ---------------------------------------------------------------------- per-operator figures
def _interp(curve: list[list[float]], x: float) -> float:
    """Log-log interpolation in ``[[x, y], ...]`` (ascending x), clamped at the ends."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
    return curve[-1][1]


@dataclass
class ComputeFigures:
    """How fast one rank computes, for the per-operator cost model.

    Attributes:
        matmul_curve: dtype -> ``[[flops_per_call, flop_per_s], ...]`` ascending; the rate of a
            matmul is interpolated log-log between the points (clamped at the ends).
        matmul_layouts: dtype -> layout ("NN", "NT", "TN") -> a curve like ``matmul_curve``,
            for matmuls whose layout the trace recorded.
        read_bandwidth: bytes/s an operator reads (or rewrites in place) from mapped memory.
        strided_bandwidth: bytes/s read by an element-wise operator that combines a row-major
            and a transposed tensor of the same shape.
        special_rate: output elements/s of arithmetic-bound element-wise operators (tanh,
            exp, softmax, ...; ``profile.memory.TRANSCENDENTAL``).
        write_curve: ``[[bytes, bytes_per_s], ...]``: the rate of writing a newly allocated
            output of that size (on a CPU a large one pays a page fault per page).
        op_overhead: seconds per operator call (dispatch, autograd), whatever its size.
        event_overhead: seconds the runtime's own hooks add per fetch event (a module's
            forward or backward: pinning, cache bookkeeping, gradient marks).
        efficiency: measured / priced time of a small causal LM's forward and backward
            (embedding, a transformer block, the LM head and the loss): the median over the
            calibrated widths, used where a model's width is unknown.
        efficiency_curve: ``[[hidden_size, efficiency], ...]`` ascending: the same ratio for
            a causal LM of each width. Narrow models fall further below their per-operator
            prices (a matmul over a 128-wide inner dimension runs slower than a square one of
            the same FLOPs; attention and layer norm are dominated by per-row work), so
            ``efficiency_at`` interpolates for the width of the model being planned.
        adam_rate: fused AdamW, elements/s for one rank.
        update_rate: elements/s of everything a CPU-device rank runs on its fp32 shards
            between backward and the next forward, as ``ElixirOptimizer`` runs it: the
            clipping norm and the scaling, the fused AdamW update and the zeroing of the
            gradient shard (``update_rate``); with several ranks, measured on all of them at
            once, since they run it in lock-step between two all-reduces and share the
            memory bus. 0 where not measured (``cost.after_backward`` then prices the passes
            one by one).
        threads: torch threads per rank these figures were measured with.
    """

    matmul_curve: dict[str, list[list[float]]] = field(default_factory=dict)
    matmul_layouts: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    read_bandwidth: float = 10e9
    strided_bandwidth: float = 2e9
    special_rate: float = 1e9
    write_curve: list[list[float]] = field(default_factory=lambda: [[1.0, 10e9]])
    op_overhead: float = 10e-6
    event_overhead: float = 0.0
    efficiency: float = 1.0
    efficiency_curve: list[list[float]] = field(default_factory=list)
    adam_rate: float = 1e9
    update_rate: float = 0.0
    threads: int = 1

    def matmul_rate(self, dtype: str, flops: float, layout: str = "") -> float:
        curve = self.matmul_layouts.get(dtype, {}).get(layout)
        if curve:
            return _interp(curve, flops)
        curve = self.matmul_curve.get(dtype) or self.matmul_curve.get("float32")
        if not curve:
            raise KeyError(dtype)
        return _interp(curve, flops)

    def write_rate(self, nbytes: float) -> float:
        return _interp(self.write_curve, nbytes)

    def efficiency_at(self, hidden_size: int | None) -> float:
        """The efficiency of a model ``hidden_size`` wide (``efficiency`` when unknown or
        when these figures predate the curve)."""
        if not hidden_size or not self.efficiency_curve:
            return self.efficiency
        return _interp(self.efficiency_curve, float(hidden_size))

    def for_width(self, hidden_size: int | None) -> "ComputeFigures":
        """These figures with ``efficiency`` set for a model ``hidden_size`` wide."""
        return replace(self, efficiency=self.efficiency_at(hidden_size))

    def copy_seconds(self, nbytes: float, fresh: bool) -> float:
        """A copy of ``nbytes`` into a new tensor (``fresh``) or into mapped memory."""
        return nbytes / self.read_bandwidth + (nbytes / self.write_rate(nbytes) if fresh else 0.0)

    @classmethod
    def from_dict(cls, data: dict) -> "ComputeFigures":
        return cls(**data)


# ---------------------------------------------------------------------- timing


def sharing(ranks_per_node: int) -> str:
    """Which ``HardwareProfile.compute`` figures a rank runs at: ``"shared"`` when several
    ranks share the node (one thread each), ``"whole"`` when one process has every core."""
    return "shared" if ranks_per_node > 1 else "whole"
