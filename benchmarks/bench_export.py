"""Peak memory of checkpoint save and export against the model's size.

Default: the 124M-parameter GPT-2 config (transformers' GPT2Config defaults), built from the
config (no download). Each measured phase runs in a fresh process with
``MALLOC_MMAP_THRESHOLD_=65536`` and ``HF_ELIXIR_KEEP_HOST_MEMORY=0`` (so freed buffers go
back to the OS and RSS shows what is held); the peak resident set during the phase is measured as the growth of VmHWM after
resetting it (``/proc/self/clear_refs``), with a 2 ms RSS sampler as a fallback.

    python benchmarks/bench_export.py                      # GPT-2 124M
    python benchmarks/bench_export.py --n-layer 24 --n-embd 256 --vocab 8192 --json out.json

Phases:
  save    ElixirModule + ElixirOptimizer (AdamW, one step) at world size 1; peak growth
          during ``hf_elixir.checkpoint.save`` over the RSS just before it.
  export  a new process that only runs ``hf_elixir.checkpoint.export``; peak growth over the
          RSS after imports. Its output is compared with the trained weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident set inside a ``with`` block, minus the resident set at its start."""

    def __enter__(self) -> "PeakRSS":
        self.start = _rss()
        self.hwm_ok = False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.hwm_ok = True
        except OSError:
            pass
        self._peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, _rss())
        if self.hwm_ok:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self._peak = max(self._peak, int(line.split()[1]) * 1024)
        self.delta = self._peak - self.start


def _config(args):
    import transformers as tf

    return tf.GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=max(1, args.n_embd // 64),
                         vocab_size=args.vocab, n_positions=args.n_positions)


def phase_save(args) -> dict:
    import torch
    import transformers as tf

    import hf_elixir as hfe
    from hf_elixir import checkpoint as ck

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(args)).float()
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1))
    eo = hfe.ElixirOptimizer(em, opt)
    ids = torch.randint(0, args.vocab, (1, 32))
    eo.backward(em(input_ids=ids, labels=ids).loss)
    eo.step()
    eo.zero_grad()
    sums = {}
    for chunk in em.chunks:  # float64 sums of every parameter, to check the export
        for slot in chunk.slots:
            sums[slot.name] = chunk.master[slot.offset : slot.offset + slot.numel].double().sum().item()
    t0 = time.time()
    with PeakRSS() as peak:
        ck.save(em, eo, args.ckpt)
    seconds = time.time() - t0
    size = sum(f.stat().st_size for f in Path(args.ckpt).iterdir())
    return {"model_bytes": model_bytes, "params": model_bytes // 4, "peak_rss_delta": peak.delta,
            "seconds": seconds, "checkpoint_bytes": size, "sums": sums, "hwm": peak.hwm_ok}


def phase_export(args) -> dict:
    from hf_elixir import checkpoint as ck

    t0 = time.time()
    with PeakRSS() as peak:
        info = ck.export(args.ckpt, args.out, max_shard_size=args.max_shard_size)
    return {"peak_rss_delta": peak.delta, "seconds": time.time() - t0, "files": info["files"],
            "largest_tensor_bytes": info["largest_tensor_bytes"], "total_bytes": info["total_bytes"],
            "hwm": peak.hwm_ok}


def _check_export(out: Path, sums: dict) -> bool:
    from safetensors import safe_open

    seen = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                seen[key] = st.get_tensor(key).double().sum().item()
    return all(seen.get(k) == v for k, v in sums.items())


def _child(phase: str, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", HF_ELIXIR_KEEP_HOST_MEMORY="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    cmd = [sys.executable, __file__, "--phase", phase, "--ckpt", str(args.ckpt), "--out", str(args.out),
           "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--vocab", str(args.vocab),
           "--n-positions", str(args.n_positions), "--max-shard-size", str(args.max_shard_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{phase} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--n-positions", type=int, default=1024)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        result = phase_save(args) if args.phase == "save" else phase_export(args)
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        args.ckpt, args.out = Path(work) / "ckpt", Path(work) / "hf"
        save = _child("save", args)
        export = _child("export", args)
        export["outputs_equal"] = _check_export(args.out, save.pop("sums"))
    mb = save["model_bytes"]
    result = {
        "config": {"n_layer": args.n_layer, "n_embd": args.n_embd, "vocab": args.vocab, "n_positions": args.n_positions},
        "params": save["params"], "model_bytes": mb, "checkpoint_bytes": save["checkpoint_bytes"],
        "save": {k: save[k] for k in ("peak_rss_delta", "seconds", "hwm")},
        "export": export,
        "ratios": {"save_peak_over_model": save["peak_rss_delta"] / mb,
                   "export_peak_over_model": export["peak_rss_delta"] / mb,
                   "export_peak_over_largest_tensor": export["peak_rss_delta"] / export["largest_tensor_bytes"]},
    }
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    print(f"\nmodel {mb / 2**20:.0f} MiB fp32 ({save['params'] / 1e6:.1f}M params); "
          f"save peak +{save['peak_rss_delta'] / 2**20:.1f} MiB ({100 * result['ratios']['save_peak_over_model']:.1f}%), "
          f"export peak +{export['peak_rss_delta'] / 2**20:.1f} MiB "
          f"({100 * result['ratios']['export_peak_over_model']:.1f}% of the model; largest tensor "
          f"{export['largest_tensor_bytes'] / 2**20:.1f} MiB), export {export['seconds']:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
