"""The host's whole share of an offloaded step, as the runtime takes it and as PyTorch's ops would.

    python benchmarks/bench_host_step.py                  # 8M elements, 1 thread and every core
    python benchmarks/bench_host_step.py --quick          # 1M elements, fewer repeats (a check)

On a GPU machine, each offloaded element costs the host more than its optimizer update: the
downloaded compute-dtype (bf16) gradient is added into the fp32 gradient shard, the shard is
clipped (a norm, a scaling), updated with its bf16 copy written, and zeroed. The add was the
largest of these: PyTorch's in-place add of a bf16 tensor into an fp32 one takes a slow
mixed-dtype path. The runtime takes none of it in a step with one backward: ``zero_grad``
only marks a staged chunk's shard zero and the download is copied in over it
(``disk_tier.clear_grad``); where a gradient is added (gradient accumulation, a CPU device's
reductions) it is widened a block at a time and added in fp32 (``runtime/widen.py``), the
mixed add's result bit for bit.

Measured here, at each thread count, alternating the two so that a busy moment of the machine
hits both:

- ``add``: the gradient's add alone, PyTorch's (``torch_mixed``) and the runtime's
  (``hf_elixir``), milliseconds;
- ``host_step``: elements per second of the host's whole step as the planner's calibration
  times it (``measure/host_rate.py``: the download's copy, the clipping's norm, the one-pass
  update taking the clipping's factor as it reads; ``hf_elixir``), the same step with the
  scaling as a pass of its own before the update (``clip_pass``, the runtime until the loop
  took the factor), and with PyTorch's mixed add into a zeroed shard, the scaling pass and
  the zeroing pass (``plain``).

Results go to ``benchmarks/results/bench_host_step.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from hf_elixir.measure.host_rate import ARMS as STEPS, host_update_rate
from hf_elixir.runtime.threads import usable_cores, using_threads
from hf_elixir.runtime.widen import add_widened
from bench_host_optimizer import machine, write_results  # the script's folder is on sys.path

RESULTS = Path(__file__).resolve().parent / "results" / "bench_host_step.json"


def torch_mixed(target: torch.Tensor, source: torch.Tensor) -> None:
    """PyTorch's own in-place add of a narrower tensor."""
    target.add_(source)


ADDS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {"torch_mixed": torch_mixed, "hf_elixir": add_widened}


def time_add(add: Callable[[torch.Tensor, torch.Tensor], None], target: torch.Tensor, source: torch.Tensor) -> float:
    start = time.perf_counter()
    add(target, source)
    return time.perf_counter() - start


def measure(elems: int, threads: int, repeats: int, dtype: torch.dtype) -> dict:
    target = torch.zeros(elems)
    source = torch.randn(elems).to(torch.bfloat16)
    check = {name: torch.zeros(elems) for name in ADDS}
    for name, add in ADDS.items():
        add(check[name], source)
    equal = torch.equal(check["torch_mixed"].view(torch.int32), check["hf_elixir"].view(torch.int32))
    adds: dict[str, list[float]] = {name: [] for name in ADDS}
    steps: dict[str, list[float]] = {name: [] for name in STEPS}
    with using_threads(threads):
        for name, add in ADDS.items():  # warm-up
            time_add(add, target, source)
        for _ in range(repeats):
            for name, add in ADDS.items():
                adds[name].append(time_add(add, target, source))
        for _ in range(max(1, repeats // 3)):
            for name in STEPS:
                steps[name].append(host_update_rate(elems, threads, dtype, arm=name))
    add_ms = {name: statistics.median(v) * 1e3 for name, v in adds.items()}
    step_rate = {name: statistics.median(v) for name, v in steps.items()}
    return {"compute_dtype": str(dtype).removeprefix("torch."), "threads": threads, "elements": elems,
            "bit_equal": equal, "add_ms": add_ms,
            "host_step_elements_per_s": step_rate,
            "add_speedup": add_ms["torch_mixed"] / add_ms["hf_elixir"],
            "host_step_speedup": step_rate["hf_elixir"] / step_rate["plain"],
            "clip_in_update_speedup": step_rate["hf_elixir"] / step_rate["clip_pass"],
            "vs_torch_kernel": step_rate["hf_elixir"] / step_rate["torch_kernel"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, usable_cores()}))
    p.add_argument("--elements", type=int, default=8 << 20)
    p.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16"), default=["bfloat16", "float16"],
                   help="compute dtypes: the gradient that comes down and the copy that goes up")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="1M elements, 3 repeats (a check, not a figure)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.elements, args.repeats = 1 << 20, 3
    rows = []
    for dtype, threads in ((d, t) for d in args.dtypes for t in args.threads):
        row = measure(args.elements, threads, args.repeats, getattr(torch, dtype))
        rows.append(row)
        print(f"{dtype}, {threads:2d} thread(s), {args.elements / 2**20:.0f}M elements: add "
              f"{row['add_ms']['torch_mixed']:.1f} ms "
              f"(PyTorch) vs {row['add_ms']['hf_elixir']:.1f} ms (hf_elixir), {row['add_speedup']:.2f}x; host step "
              f"{row['host_step_elements_per_s']['plain'] / 1e6:.0f} (plain) vs "
              f"{row['host_step_elements_per_s']['clip_pass'] / 1e6:.0f} (a clipping pass) vs "
              f"{row['host_step_elements_per_s']['torch_kernel'] / 1e6:.0f} (PyTorch's kernel) vs "
              f"{row['host_step_elements_per_s']['hf_elixir'] / 1e6:.0f} M elements/s, {row['host_step_speedup']:.2f}x "
              f"plain, {row['clip_in_update_speedup']:.2f}x the clipping pass, {row['vs_torch_kernel']:.2f}x "
              f"PyTorch's kernel; "
              f"bit equal: {row['bit_equal']}", flush=True)
    write_results(args.out, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
