"""On a CPU device the runtime keeps freed memory mapped (runtime/host_memory.py).

Checked on the real mechanism, in fresh processes (the setting is process-wide): after an
ElixirModule exists, re-allocating a large tensor takes no page faults; with
HF_ELIXIR_KEEP_HOST_MEMORY=0, every 4 KiB page faults again, as under glibc's defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import json, resource, torch
from transformers import AutoModelForCausalLM, GPT2Config
import hf_elixir as hfe
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size=1), device="cpu")
n = 64 * 2**20 // 4  # 64 MiB: above glibc's largest mmap threshold
t = torch.ones(n); del t  # the first allocation maps it
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = torch.ones(n)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
from hf_elixir.runtime.host_memory import keep_freed_host_memory
print(json.dumps({"faults": faults, "kept": keep_freed_host_memory()}))
"""


def probe(keep: str | None) -> dict:
    env = dict(os.environ)
    env.pop("HF_ELIXIR_KEEP_HOST_MEMORY", None)
    if keep is not None:
        env["HF_ELIXIR_KEEP_HOST_MEMORY"] = keep
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_runtime_reuses_freed_memory_without_page_faults():
    pages = 64 * 2**20 // 4096
    kept = probe(None)
    assert kept["kept"] is True
    assert kept["faults"] < pages // 100, kept  # reused: (almost) no page is faulted in again
    default = probe("0")
    assert default["kept"] is False
    assert default["faults"] >= pages * 0.9, default  # glibc's default: a fresh mapping per tensor
