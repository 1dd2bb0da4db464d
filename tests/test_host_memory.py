"""The host heap of CPU ranks (runtime/host_memory.py), checked on the real mechanism.

- After an ElixirModule exists on a CPU device, re-allocating a large tensor takes no page
  faults; with HF_ELIXIR_KEEP_HOST_MEMORY=0 every 4 KiB page faults again (glibc's
  defaults). Fresh processes (the setting is process-wide), started as the launcher starts
  CPU ranks.
- Two gloo ranks started as ``hf-elixir launch`` starts them keep a flat resident size over
  many steps (before the launcher set glibc's per-thread cache off, this run grew by tens
  of MB a step, without end).
- Ranks started without it are warned, and the HeapGuard keeps their resident memory
  within its bound.
"""

from __future__ import annotations

import json
import subprocess
import sys

from harness import run_distributed
from heap_worker import train_and_watch_rss

import hf_elixir.runtime.host_memory as host_memory
from hf_elixir.runtime.host_memory import HeapGuard, rank_environment

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

STEPS = 60
MB = 2**20


def probe(keep: str | None) -> dict:
    """The probe in a fresh process started as the launcher starts CPU ranks. Without that
    environment, glibc's per-thread cache makes reuse a matter of luck (3 probes in 10
    faulted every page in again)."""
    env = rank_environment()
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


def test_cpu_ranks_started_by_the_launcher_keep_a_flat_heap():
    for r, out in enumerate(run_distributed(train_and_watch_rss, 2, STEPS, None, timeout=600)):
        settled = out["rss"][9]
        late = max(out["rss"][10:])
        assert late <= settled * 1.05 + 16 * MB, (r, [x // MB for x in out["rss"]])
        assert out["trims"] == 0 and not out["warnings"], out


def test_ranks_started_without_it_are_warned_and_kept_within_the_guard():
    growth = 1.2
    for out in run_distributed(train_and_watch_rss, 2, STEPS, growth, timeout=600, launcher_env=False):
        assert any("GLIBC_TUNABLES=glibc.malloc.tcache_count=0" in w for w in out["warnings"]), out["warnings"]
        # between steps resident memory never stays above the guard's bound: a step that ends
        # above it trims (one step's growth, a few tens of MB, may pass it before the trim)
        baseline = out["rss"][HeapGuard.settle_steps - 1]
        assert max(out["rss"]) <= growth * max(baseline, out["baseline"]) + 64 * MB, [x // MB for x in out["rss"]]


def test_heap_guard_trims_past_its_bound_and_follows_real_growth(monkeypatch):
    """The policy alone, on scripted resident sizes: no trim while the heap settles, a trim
    above growth x the settled size, and a trim that cannot get back under the old size
    (the run needs more) moves the mark up to what is left."""
    trims = []

    class FakeLibc:
        def malloc_trim(self, pad):
            trims.append(pad)
            return 1

    readings: list[int] = []
    monkeypatch.setattr(host_memory, "_LIBC", FakeLibc())
    monkeypatch.setattr(host_memory, "resident_bytes", lambda: readings.pop(0))
    guard = HeapGuard(growth=1.5, settle_steps=3)
    # (resident size after the step, what a trim leaves)
    script = [(500, None), (500, None), (100, None), (120, None), (160, 90), (140, None),
              (200, 170), (240, None), (260, 200)]
    did = []
    for step, (rss, left) in enumerate(script, start=1):
        # nothing is read while the heap settles; a trim reads the size once more
        readings[:] = ([rss] if step >= guard.settle_steps else []) + ([left] if left is not None else [])
        did.append(guard.after_step())
        assert not readings
        if len(did) == 5:
            assert guard.baseline == 100  # the trim got back under the settled size
    assert did == [False, False, False, False, True, False, True, False, True]
    assert guard.baseline == 200 and guard.trims == len(trims) == 3
