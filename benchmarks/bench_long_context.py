"""Long context on CPU: peak memory and step time against the sequence length, hf_elixir with
every block's input offloaded and the logits in pieces against plain PyTorch with the
model's own gradient checkpointing, and the planner's predicted peak beside each (issue 61,
point 5 and acceptance 4).

    python benchmarks/bench_long_context.py                 # 4 layers, hidden 256, 1k..8k tokens
    python benchmarks/bench_long_context.py --seq-lens 1024 4096 --steps 1
    python benchmarks/bench_long_context.py --quick         # tiny model, two short lengths

The model: a Llama-style decoder (``--layers`` 4, hidden 256, intermediate 688, 4 heads, 2
key-value heads, vocabulary 32,000, SDPA attention, untied head), fp32, seed 0, batch 1, the
same token batch for both systems at each length; torch AdamW (lr 1e-4). One process, one
thread count for both systems (the machine's default), glibc's allocator for both.

Systems, at each length, one after the other in the same process:

- ``plain``:     the model's own ``gradient_checkpointing_enable()`` (every decoder block
                 recomputed, its input kept), the model's own loss over the whole logits.
- ``hf_elixir``: ``ElixirModule`` over ``ElixirPlan.simple`` (world size 1) with
                 ``block_policies`` ``recompute_offload`` for every block and
                 ``logit_piece_tokens`` ``--piece`` (1,024; the planner's smallest piece).

Peak memory, the same instrument for both systems and for the prediction: the planner's own
``LiveStorageTracker`` (a ``TorchDispatchMode`` that counts the bytes of every storage an
operator creates, until it dies), opened after a warm-up step and around one forward and
backward. What existed before (weights, gradient buffers kept from the warm-up step,
optimizer state, the batch) is not counted; so the figure is the activations and
temporaries of a step, which is what the sequence length grows and what the planner's
activation model predicts (``planner/activations.py``: ``ActivationModel.peak``, the
bytes above the step's state at its worst instant). The plain run keeps its gradient
buffers between steps (``zero_grad(set_to_none=False)``), as hf_elixir keeps its chunks'.

On a CPU the "host" copies of an offloaded block are other allocations of the same memory.
On a GPU they live in pinned host memory, not on the device; the planner's peak is the
device's. So the tracker leaves out the storages the offloader makes for its host copies
(it is told when the offloader copies out; the copies back to the device are counted), and
the host bytes are reported apart (``host_peak_bytes``, the runtime's own count).

The prediction: a CPU plan does not use the long-context levers (nothing to offload to on a
machine whose device is the host), so the benchmark does not ask ``hfe.plan`` for one.
It profiles the model at each length on the meta device (``profile_model``, CPU attention
kernels, fp32: what the planner profiles) and asks the planner's activation model for the
peak of exactly the configuration run: ``Levers(("recompute_offload",) * layers,
logit_piece_tokens=piece)`` for hf_elixir and ``("recompute",) * layers`` with whole logits
for plain. ``ratio`` is predicted over measured.

Step time: the median of ``--steps`` timed optimizer steps (forward, backward, step) after
the warm-up and the measured step. ``loss`` agreement: both systems start from the same
weights on the same batch, so their first losses agree within 1e-5 relative and their
later ones within 1e-4 (the logits' pieces reduce in another order).

Results go to benchmarks/results/bench_long_context.json (``--quick``: a temporary file
unless ``--output`` is given).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

import hf_elixir as hfe
from hf_elixir.planner import activations
from hf_elixir.planner.activations import Levers
from hf_elixir.profile import profile_model
from hf_elixir.profile.memory import LiveStorageTracker, _storage_key
from hf_elixir.runtime.activation_offload import ActivationOffloader

RESULTS = Path(__file__).resolve().parent / "results"
LR = 1e-4
MODEL = {"layers": 4, "hidden": 256, "intermediate": 688, "heads": 4, "kv_heads": 2, "vocab": 32000}
QUICK_MODEL = {"layers": 2, "hidden": 64, "intermediate": 176, "heads": 4, "kv_heads": 2, "vocab": 32000}
DEFAULTS = {"seq_lens": [1024, 2048, 4096, 8192], "piece": 1024, "steps": 2}
QUICK = {"seq_lens": [256, 512], "piece": 128, "steps": 1}
SYSTEMS = ("plain", "hf_elixir")
TOP = 6  # storages listed at each peak

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*is deprecated")


# ---------------------------------------------------------------------- model
def config_of(shape: dict, max_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
                       max_position_embeddings=max_len, tie_word_embeddings=False, use_cache=False,
                       bos_token_id=0, eos_token_id=0)


def build(config) -> torch.nn.Module:
    """The seeded model: the same weights for both systems."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def blocks(config) -> list[str]:
    return [f"model.layers.{i}" for i in range(config.num_hidden_layers)]


# ---------------------------------------------------------------------- the instrument
class DeviceTracker(LiveStorageTracker):
    """``LiveStorageTracker`` that leaves out storages made while ``host_side`` is set: the
    offloader's host copies, which on a GPU are pinned host memory, not device memory."""

    def __init__(self) -> None:
        super().__init__(count_flops=False)
        self.host_side = False
        #: the largest storages alive at the peak, bytes (where a gap to the prediction is)
        self.at_peak: list[int] = []

    def _track(self, t: torch.Tensor) -> int:
        if not self.host_side:
            nbytes = super()._track(t)
            if nbytes and self.current >= self.peak:  # a new peak: what makes it up
                self.at_peak = sorted((n for _, n in self._live.values()), reverse=True)[:TOP]
            return nbytes
        st = t.untyped_storage()
        key = _storage_key(st)
        if key not in self._live and key not in self._excluded:
            self._excluded.add(key)
            weakref.finalize(st, self._excluded.discard, key)
        return 0


class HostCopiesAside:
    """While open, every copy the offloader makes to the host runs with the tracker's
    ``host_side`` set (the copies back to the device are counted as usual)."""

    def __init__(self, tracker: DeviceTracker) -> None:
        self.tracker = tracker
        self.original = ActivationOffloader._copy

    def __enter__(self) -> "HostCopiesAside":
        original, tracker = self.original, self.tracker

        def copy(offloader, group, to_host, current=False):
            tracker.host_side = to_host
            try:
                return original(offloader, group, to_host, current)
            finally:
                tracker.host_side = False

        ActivationOffloader._copy = copy
        return self

    def __exit__(self, *exc) -> None:
        ActivationOffloader._copy = self.original


# ---------------------------------------------------------------------- systems
class System(NamedTuple):
    """One way to run a step, in two halves: ``forward_backward(ids)`` returns the loss (what
    the tracker measures), ``optimizer_step()`` updates and zeroes; ``report``: the
    runtime's ``memory_report`` (hf_elixir only). A named tuple, not a dataclass, so that a
    test can load this file as a module without registering it."""

    model: torch.nn.Module
    forward_backward: Callable[[torch.Tensor], float]
    optimizer_step: Callable[[], None]
    report: Optional[Callable[[], dict]] = None


def plain_system(config) -> System:
    model = build(config)
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def fb(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    def step():
        opt.step()
        opt.zero_grad(set_to_none=False)  # the buffers stay, as hf_elixir's chunks do

    return System(model, fb, step)


def elixir_system(config, piece: int, seq: int) -> System:
    model = build(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    plan = hfe.ElixirPlan.simple(model, 1, example_batch=(1, min(seq, 256)))
    plan = dataclasses.replace(plan, block_policies={b: "recompute_offload" for b in blocks(config)},
                               logit_piece_tokens=piece)
    emodel = hfe.ElixirModule(model, plan)
    eopt = hfe.ElixirOptimizer(emodel, opt)

    def fb(ids):
        loss = emodel(input_ids=ids, labels=ids).loss
        eopt.backward(loss)
        return float(loss.detach())

    def step():
        eopt.step()
        eopt.zero_grad()

    return System(emodel, fb, step, report=emodel.memory_report)


def run_system(system: System, ids: torch.Tensor, steps: int) -> dict:
    """A warm-up step, one measured forward and backward (then its optimizer step), and
    ``steps`` timed steps."""
    losses = [system.forward_backward(ids)]
    system.optimizer_step()
    tracker = DeviceTracker()
    with HostCopiesAside(tracker), tracker:
        losses.append(system.forward_backward(ids))
    system.optimizer_step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(system.forward_backward(ids))
        system.optimizer_step()
        times.append(time.perf_counter() - start)
    row = {"losses": losses, "peak_bytes": tracker.peak, "largest_at_peak_bytes": tracker.at_peak,
           "step_s": times, "median_step_s": statistics.median(times)}
    if system.report is not None:
        offload = system.report()["activation_offload"]
        row["host_peak_bytes"] = offload["peak_host_bytes"]
        row["activation_offload"] = offload
    return row


# ---------------------------------------------------------------------- prediction
def predicted(config, seq: int, piece: int) -> dict:
    """The planner's activation peak for exactly the configurations run, from its profile."""
    prof = profile_model(config, (1, seq), dtype="float32", attention_target="cpu", fold=False)
    n_ck, n_pl = len(prof.checkpointed.trace.events), len(prof.plain.trace.events)
    # times do not enter the peak; zero host link: the device is the host
    model = activations.model_of(prof, [0.0] * n_ck, [0.0] * n_pl, 0.0, 0.0, 0.0)
    if model is None:
        raise RuntimeError("the planner cannot cut this model's profile at its blocks")
    n = config.num_hidden_layers
    return {"plain": int(model.peak(Levers(("recompute",) * n))),
            "hf_elixir": int(model.peak(Levers(("recompute_offload",) * n, logit_piece_tokens=piece)))}


# ---------------------------------------------------------------------- main
def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model at two short lengths")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None)
    p.add_argument("--piece", type=int, default=None, help="logit_piece_tokens for hf_elixir")
    p.add_argument("--steps", type=int, default=None, help="timed steps per system and length")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.piece < 1 or args.steps < 1 or any(s < 2 for s in args.seq_lens):
        p.error("--piece and --steps must be at least 1 and every --seq-lens at least 2")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    shape = dict(QUICK_MODEL if args.quick else MODEL)
    if args.layers is not None:
        shape["layers"] = args.layers
    config = config_of(shape, max(args.seq_lens))
    results: dict = {"config": {**shape, "seq_lens": args.seq_lens, "piece": args.piece, "steps": args.steps,
                                "dtype": "float32", "batch": 1, "threads": torch.get_num_threads(),
                                "torch": torch.__version__, "quick": args.quick},
                     "summary": {}}
    for seq in args.seq_lens:
        ids = torch.randint(0, shape["vocab"], (1, seq), generator=torch.Generator().manual_seed(seq))
        pred = predicted(config, seq, args.piece)
        rows = {"plain": run_system(plain_system(config), ids, args.steps),
                "hf_elixir": run_system(elixir_system(config, args.piece, seq), ids, args.steps)}
        for name, row in rows.items():
            row["predicted_peak_bytes"] = pred[name]
            row["ratio"] = pred[name] / row["peak_bytes"]
        plain, ours = rows["plain"], rows["hf_elixir"]
        first = abs(ours["losses"][0] - plain["losses"][0]) <= 1e-5 * abs(plain["losses"][0])
        later = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(ours["losses"], plain["losses"]))
        rows["compare"] = {"peak_vs_plain": ours["peak_bytes"] / plain["peak_bytes"],
                           "step_vs_plain": ours["median_step_s"] / plain["median_step_s"],
                           "losses_match": bool(first and later),
                           "losses_finite": all(math.isfinite(x) for x in ours["losses"] + plain["losses"])}
        results["summary"][str(seq)] = rows
        print(f"seq {seq:>6}: plain peak {plain['peak_bytes'] / 2**20:8.1f} MiB (predicted "
              f"{pred['plain'] / 2**20:8.1f}, ratio {plain['ratio']:.3f}) step {plain['median_step_s']:.2f} s | "
              f"hf_elixir peak {ours['peak_bytes'] / 2**20:8.1f} MiB (predicted {pred['hf_elixir'] / 2**20:8.1f}, "
              f"ratio {ours['ratio']:.3f}) step {ours['median_step_s']:.2f} s | losses match "
              f"{rows['compare']['losses_match']}", flush=True)
    out = args.output or (Path(tempfile.mkdtemp()) / "bench_long_context.json" if args.quick
                          else RESULTS / "bench_long_context.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
