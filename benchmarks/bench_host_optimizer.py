"""How fast the host updates optimizer state, against the kernels it could use and the bound.

    python benchmarks/bench_host_optimizer.py                  # this machine, its cores
    python benchmarks/bench_host_optimizer.py --threads 1 2    # several thread counts
    python benchmarks/bench_host_optimizer.py --quick          # a smaller model, fewer repeats

An offloaded chunk's update reads the fp32 master, the gradient and Adam's two moments and
writes three of them back: 28 bytes per parameter, 30 when the compute-dtype copy (bf16 or
fp16) that goes back to the GPU is written too. Memory bandwidth bounds it: the bound printed here
is the machine's measured streaming bandwidth divided by those bytes. The bandwidth is taken
from a pass with the update's own access pattern, an in-place add over buffers far larger
than the caches (two read, one written back where it was read: 12 bytes an element). A
plain ``copy_`` into another buffer understates it: each line it writes is first read into
the cache (read for ownership), bus traffic its byte count leaves out, while an update
writes only what it has just read.

Measured, at each thread count, over the same parameters (a GPT-2-shaped model's, all in
one chunk, about 60M of them):

- ``hf_elixir``: the runtime's own update of offloaded state (every chunk's optimizer state
  on the host), timed by its step breakdown (``time_report()``: ``cpu_optimizer`` plus
  ``host_copies``, the update and the compute-dtype copy) inside real training steps of an
  ``ElixirModule`` on the CPU. Under bf16 and fp16 that is the one-pass loop
  (``runtime/host_kernel.py``), which writes the copy in the same pass; in fp32 the master is
  the shard, there is no copy, and it is PyTorch's fused kernel (``hf_elixir_kernel`` in each
  row says which ran);
- ``torch_fused_flat``: ``torch.optim.AdamW``'s fused kernel called once over the chunk's
  flat buffers (and, in bf16 and fp16, one cast into the compute-dtype copy);
- ``torch_fused_per_param``: the same kernel over each parameter (plain PyTorch's step);
- ``deepspeed_cpu_adam``: DeepSpeed's ``DeepSpeedCPUAdam`` over the flat buffers (and the
  same cast), where DeepSpeed and its CPU Adam op build on this machine.

Each figure is the median over repeats, the systems interleaved so that a busy moment of the
machine hits all of them. Results go to ``benchmarks/results/host_optimizer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.optim.adamw import adamw

from hf_elixir.runtime.threads import usable_cores

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "host_optimizer.json"
HYPER = dict(beta1=0.9, beta2=0.999, lr=1e-4, weight_decay=0.01, eps=1e-8)


def stream_bandwidth(threads: int, elements: int = 1 << 26, repeats: int = 7) -> float:
    """Bytes read plus written per second by ``a.add_(b)`` over two buffers of ``elements``
    fp32 values (256 MiB each by default: far beyond any cache)."""
    torch.set_num_threads(threads)
    a, b = torch.zeros(elements), torch.full((elements,), 1e-30)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t)
    return 3 * 4 * elements / statistics.median(times)


def build_model(width: int, layers: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=width, n_layer=layers,
                                      n_head=max(1, width // 64), bos_token_id=0, eos_token_id=0))


class Flat:
    """The state of one chunk as flat buffers, and its parameters' views of them."""

    def __init__(self, shapes: list[torch.Size], dtype: torch.dtype) -> None:
        n = sum(s.numel() for s in shapes)
        g = torch.Generator().manual_seed(0)
        self.master = torch.randn(n, generator=g) * 0.02
        self.grad = torch.randn(n, generator=g) * 1e-3
        self.exp_avg = torch.zeros(n)
        self.exp_avg_sq = torch.zeros(n)
        self.copy = torch.empty(n, dtype=dtype) if dtype != torch.float32 else None
        self.sizes = [s.numel() for s in shapes]
        self.step = torch.zeros(())
        self.steps = [torch.zeros(()) for _ in shapes]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, start = [], 0
        for n in self.sizes:
            out.append(flat[start:start + n])
            start += n
        return out

    def cast(self) -> None:
        if self.copy is not None:
            self.copy.copy_(self.master)


def torch_fused_flat(state: Flat) -> Callable[[], None]:
    def run() -> None:
        adamw([state.master], [state.grad], [state.exp_avg], [state.exp_avg_sq], [], [state.step],
              fused=True, foreach=None, amsgrad=False, maximize=False, **HYPER)
        state.cast()
    return run


def torch_fused_per_param(state: Flat) -> Callable[[], None]:
    lists = [state.views(t) for t in (state.master, state.grad, state.exp_avg, state.exp_avg_sq)]

    def run() -> None:
        adamw(*lists, [], state.steps, fused=True, foreach=None, amsgrad=False, maximize=False, **HYPER)
        state.cast()
    return run


def deepspeed_cpu_adam(state: Flat) -> tuple[Optional[Callable[[], None]], str]:
    """DeepSpeedCPUAdam over the flat master (its gradient the flat gradient), or why not."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or its op does not build here
        return None, f"deepspeed not importable: {exc!r}"[:300]
    param = torch.nn.Parameter(state.master, requires_grad=True)
    param.grad = state.grad
    try:
        opt = DeepSpeedCPUAdam([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                               eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], adamw_mode=True)
        opt.step()
    except Exception as exc:
        return None, f"DeepSpeedCPUAdam failed: {exc!r}"[:300]

    def run() -> None:
        opt.step()
        state.cast()
    import deepspeed
    return run, f"deepspeed {deepspeed.__version__}"


class ElixirUpdate:
    """The runtime's own update of offloaded state, in real training steps: every chunk's
    optimizer state on the host, updated inside ``step()`` (``overlap_host=False``: the same
    loop the host thread runs, timed on the main thread). Each call returns the seconds its
    step breakdown gave the update and the compute-dtype copy."""

    def __init__(self, model, dtype: torch.dtype, threads: int) -> None:
        import hf_elixir as hfe

        os.environ["HF_ELIXIR_HOST_THREADS"] = str(threads)
        total = sum(p.numel() for p in model.parameters())
        plan = hfe.ElixirPlan.simple(model, 1, chunk_size=total, compute_dtype=dtype, example_batch=(1, 8),
                                     offload_fraction=1.0)
        self.emodel = hfe.ElixirModule(model, plan)
        self.opt = hfe.ElixirOptimizer(self.emodel, torch.optim.AdamW(
            model.parameters(), lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"]), overlap_host=False)
        #: how the host update ran: the one-pass loop (update and copy), or PyTorch's fused
        #: kernel, with a cast where the compute dtype needs a copy (the reason with it)
        if all(c.master_aliased for c in self.emodel.chunks):
            self.kernel = "torch fused (the master is the shard: no copy to write)"
        elif self.opt.one_pass is not None:
            self.kernel = "one pass (update and copy)"
        else:
            self.kernel = f"torch fused + cast ({hfe.runtime.host_kernel.OnePassAdam(threads).why_not})"
        self.ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        self()  # the first step records the pass's trace

    def __call__(self) -> float:
        self.emodel.time_report(reset=True)
        self.opt.backward(self.emodel(input_ids=self.ids, labels=self.ids).loss)
        skipped = getattr(self.opt, "skipped_steps", 0)
        self.opt.step()
        self.opt.zero_grad()
        if getattr(self.opt, "skipped_steps", 0) != skipped:  # fp16: an inf gradient, no update to time
            raise RuntimeError("the fp16 step was skipped (an inf or NaN gradient): no update was timed")
        last = self.emodel.time_report()["last"]
        return last["device_optimizer"] + last["cpu_optimizer"] + last["host_copies"]


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(threads: int, dtype: torch.dtype, args) -> dict:
    torch.set_num_threads(threads)
    model = build_model(args.width, args.layers, args.vocab)
    shapes = [p.shape for p in model.parameters()]
    n = sum(s.numel() for s in shapes)
    state = Flat(shapes, dtype)
    systems: dict[str, Callable[[], float]] = {
        "torch_fused_flat": lambda f=torch_fused_flat(state): timed(f),
        "torch_fused_per_param": lambda f=torch_fused_per_param(state): timed(f),
    }
    ds, ds_note = deepspeed_cpu_adam(state)
    if ds is not None:
        systems["deepspeed_cpu_adam"] = lambda: timed(ds)
    elixir = systems["hf_elixir"] = ElixirUpdate(model, dtype, threads)
    samples: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.repeats):  # interleaved: a busy moment hits every system
        for name, run in systems.items():
            torch.set_num_threads(threads)
            samples[name].append(run())
    bytes_per_param = 28 + (dtype.itemsize if dtype != torch.float32 else 0)
    bandwidth = stream_bandwidth(threads)
    rates = {name: n / statistics.median(s) for name, s in samples.items()}
    bound = bandwidth / bytes_per_param
    return {
        "threads": threads, "compute_dtype": str(dtype).replace("torch.", ""), "parameters": n,
        "bytes_per_parameter": bytes_per_param, "stream_bandwidth_bytes_per_s": bandwidth,
        "bound_params_per_s": bound, "params_per_s": rates,
        "seconds": {name: statistics.median(s) for name, s in samples.items()},
        "hf_elixir_vs_bound": rates["hf_elixir"] / bound,
        "hf_elixir_vs": {name: rates["hf_elixir"] / r for name, r in rates.items() if name != "hf_elixir"},
        "deepspeed": ds_note,
        "hf_elixir_kernel": elixir.kernel,
    }


def machine() -> dict:
    """What the figures were measured on (also bench_resident.py's)."""
    return {"cores": usable_cores(), "threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": platform.processor(), "torch": torch.__version__, "python": sys.version.split()[0]}


def write_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = usable_cores()
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="a small model and 3 repeats (a check, not a figure)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.width, args.layers, args.vocab, args.repeats = 256, 2, 1024, 3
    rows = []
    for dtype in args.dtypes:
        for threads in args.threads:
            row = measure(threads, getattr(torch, dtype), args)
            rows.append(row)
            rates = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in row["params_per_s"].items())
            print(f"{row['compute_dtype']:8s} {threads:2d} thread(s): M params/s {rates}; bound "
                  f"{row['bound_params_per_s'] / 1e6:.0f} (stream {row['stream_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s); "
                  f"hf_elixir {row['hf_elixir_vs_bound']:.2f}x the bound, "
                  + ", ".join(f"{v:.2f}x {k}" for k, v in row["hf_elixir_vs"].items()), flush=True)
    write_results(args.out, {"machine": machine(),
                             "model": {"width": args.width, "layers": args.layers, "vocab": args.vocab},
                             "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
