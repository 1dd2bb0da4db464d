"""The GPU suite: one short run that checks and measures hf_elixir on a CUDA machine.

    bash benchmarks/gpu_suite.sh                  # on one GPU; about 5 minutes, 8 at most
    bash benchmarks/gpu_suite.sh --dry-run        # on a CPU, tiny models, every step (CI runs it)

Sections, in the order they run (each job in a process of its own, with a timeout; the whole
run has a deadline, so a stuck job cannot eat the time of the sections after it, and the
most telling sections come first, since the deadline cuts what comes last; ``--sections``
runs some of them, so a second call can run what a first one's deadline cut). On a GPU one
job runs at a time, so no job's timing shares the device; a dry run measures nothing and
runs two at a time (``lanes`` in the settings: the smoke test's two jobs side by side, then
the sections after it two by two), so CI's two cores are both busy:

1. smoke: the equivalence recipe at world size 1 on the device (fp32 plans against plain
   PyTorch, bf16 against fp32), directly and under ``torchrun --nproc_per_node 1`` (NCCL on
   a GPU). If anything differs the suite stops there: its numbers would mean nothing.
2. offload_24g: GPT-2 1.5B (48 layers, 1600 wide), bf16, sequence 1024, allocations capped
   at 24 GiB: hf_elixir with its planned plan, FSDP2 with CPUOffloadPolicy, DeepSpeed
   ZeRO-3 with optimizer and parameter offload; 1 warm-up and 3 timed steps each; an
   out-of-memory error is recorded as a result.
3. trainer: a stock Trainer script (``benchmarks/trainer_speed.py``: GPT-2 124M, bf16, batch
   8 x 512, 10 warm-up and 40 timed steps) started plainly, then under ``hf-elixir launch``
   with nothing offloaded (``offloads`` in the settings adds others, e.g. ``all``): tokens/s,
   and hf_elixir's over the plain Trainer's (``vs_plain``).
4. scale: the largest Llama-style model hf_elixir trains under the 24 GiB cap at a batch
   that makes offload worthwhile (8 x 1024; where it does not fit, as the planner's largest
   micro-batch that does, accumulated to the same batch), 1 warm-up and 2 timed steps,
   trying 7B, then 13B (planned from the config first: a plan that cannot fit the
   machine's host memory is refused in seconds, not after minutes of loading).
5. mfu: the offload_24g model without a cap (it fits): hf_elixir's model FLOPs utilisation next
   to FSDP2's.
6. recovery: the section-2 model trained 3 steps, then squeezed until a step really runs
   out of memory (allocations capped at 80%, 65%, 50%, then 40% of the peak those steps
   reached, one step at each), then 2 more steps at that cap: whether the runtime recovers
   from the errors (docs/recovery.md), what it changed, how long the recovering step took
   and the throughput after it. A dry run injects the error at the first cap instead.
7. disk_tier: ``benchmarks/bench_disk_tier.py`` on the device (issue 38): a 24-layer,
   1024-wide model (25M parameters, 12 chunks) trained 2 + 4 steps with half of the
   trainable chunks' optimizer state on the disk tier and, in fresh processes, all of it on
   the host tier; the disk's measured read and write bandwidth (before and after), one
   step's disk traffic against it, the step-time ratio disk/host and whether the weights and
   losses are bit-identical. The tier's files go in a scratch directory beside the results
   file (the disk the results go to, not a tmpfs ``/tmp``; ``--disk-path`` elsewhere),
   removed at the end. About a minute; a dry run runs ``--quick`` on the CPU.
8. trainer_compiled: section 3's script with ``--torch_compile true`` (issue 64): the plain
   Trainer compiles the whole model, ``hf-elixir launch`` compiles each decoder layer (the
   chunk hooks outside the compiled code); tokens/s after the warm-up steps (which carry the
   compile), ``vs_plain`` against the plain compiled Trainer, the target (``target_vs_plain``,
   0.95) and, on a GPU, whether it is met; dynamo's counters from each run show that compile
   ran. Late, since compiling costs a minute or two of the deadline: ``--sections
   trainer_compiled`` runs it alone.
9. long_context (issue 61): a Llama-2-7B-shaped LoRA fine-tune (r 16, bf16, batch 1; no
   bitsandbytes on the GPU machine) at the longest sequence the plan allows under the 24 GiB
   cap (``planner/longest.py``, probes in steps of 4,096 tokens from 16,384, as
   ``hf-elixir plan --seq-len max --lora-r 16`` searches), then 1 warm-up and 2 timed steps
   with that plan (its block policies: inputs offloaded, logits in pieces): the measured
   peak (``torch.cuda.max_memory_allocated``) and step against the plan's (``peak_ratio``,
   ``step_ratio``). Last, since it takes minutes: ``--sections long_context`` runs it alone.
   A dry run plans and trains a two-block Llama on the CPU (one probe, 512 tokens), where the
   measured peak is the runtime's ledger, not comparable to a device's.
10. fidelity: the plan's predicted peak memory and step time against the measured ones,
   for hf_elixir in sections 2 and 4.

Results: ``benchmarks/results/gpu_suite.json`` (``--out`` elsewhere; a dry run writes to a
temporary file unless ``--out`` is given, so CI never overwrites the committed results)
and a one-screen summary. Exit status 1 when the smoke test fails or a job errs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOBS = HERE / "gpu_suite_jobs.py"
RESULTS = HERE / "results" / "gpu_suite.json"
GiB = 2**30

GPT2_XL = {"name": "gpt2-1.5b", "family": "gpt2",
           "kwargs": dict(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024)}
GPT2_SMALL = {"name": "gpt2-124m", "family": "gpt2",
              "kwargs": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)}
GPU_SETTINGS = {
    "budget_s": 480, "device": "cuda", "cap_bytes": 24 * GiB,
    "lanes": 1,  # one job at a time: every timing has the GPU and the host to itself
    "gpt2": GPT2_XL, "batch": 8, "seq": 1024, "dtype": "bf16",
    "scale": [{"name": "llama-2-7b", "known": "llama-2-7b"}, {"name": "llama-2-13b", "known": "llama-2-13b"}],
    # a batch at which offload is worth its traffic; run as micro-batches where it does not fit
    "scale_batch": 8, "scale_seq": 1024, "scale_warmup": 1, "scale_steps": 2,
    # the recovery section's caps, as fractions of the warm-up peak, until a step fails
    "squeeze": [0.8, 0.65, 0.5, 0.4],
    # per job: (the most seconds it may take, the least worth starting it with); sections run
    # in the order of SECTIONS, the most telling first, and a job is skipped when the
    # deadline leaves it less than its least
    "timeouts": {"smoke": (100, 60), "smoke_torchrun": (60, 30), "hf_elixir": (100, 45), "fsdp2": (100, 40),
                 "deepspeed": (130, 60), "mfu": (75, 40), "scale": (170, 90), "recovery": (100, 45),
                 "disk_tier": (120, 45), "trainer": (90, 40), "trainer_compiled": (240, 120),
                 "long_context": (420, 200)},
    # how long the offload section waits, after the smoke test, for DeepSpeed's CPU Adam to compile
    "cpu_adam_build_wait_s": 60,
    "smoke_archs": ["gpt2", "llama"], "smoke_plans": ["a_all_device", "b_rcache2", "c_half_optim_cpu",
                                                      "d_all_cpu", "e_checkpointing"],
    # 24 layers of 1024 x 1024, 2 a chunk: 12 chunks, 6 of them (about 150 MB of fp32 master
    # and Adam moments) on disk; a minute with both systems' process starts
    "disk_tier": {"width": 1024, "layers": 24, "layers_per_chunk": 2, "warmup": 2, "steps": 4,
                  "disk_total": 128 * 2**20},
    # a stock Trainer script, plain and under hf-elixir launch with each offload setting
    "trainer": {"model": GPT2_SMALL, "batch": 8, "seq": 512, "warmup": 10, "steps": 40, "offloads": ["none"]},
    # the same script compiled (torch_compile=True), plain and under hf-elixir launch
    "trainer_compiled": {"model": GPT2_SMALL, "batch": 8, "seq": 512, "warmup": 10, "steps": 40,
                         "offloads": ["none"], "target_vs_plain": 0.95},
    # issue 61: the longest sequence a 7B LoRA plan allows under the cap, trained with that plan
    "long_context": {"model": {"name": "llama-2-7b", "known": "llama-2-7b"}, "lora_r": 16, "granule": 4096,
                     "start": 16384, "limit": 131072, "warmup": 1, "steps": 2},
}
TINY = dict(vocab_size=512, bos_token_id=0, eos_token_id=0)
TINY_GPT2 = {"name": "gpt2-tiny", "family": "gpt2", "kwargs": dict(TINY, n_layer=2, n_embd=64, n_head=4, n_positions=64)}
TINY_LLAMA = dict(TINY, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
DRY_SETTINGS = {
    "budget_s": 420, "device": "cpu", "cap_bytes": None,
    "lanes": 2,  # nothing is measured: two jobs at once keep a 2-core CI machine busy
    "gpt2": TINY_GPT2, "batch": 2, "seq": 32, "dtype": "bf16",
    # the first under a budget its batch of 8 does not fit (about a quarter of its unsplit
    # plan's peak): the planner's largest micro-batch that fits, as on the GPU
    "scale": [{"name": "llama-tiny-64", "family": "llama", "kwargs": dict(TINY_LLAMA, hidden_size=64, intermediate_size=128),
               "cap_bytes": 1_500_000},
              {"name": "llama-tiny-128", "family": "llama", "kwargs": dict(TINY_LLAMA, hidden_size=128, intermediate_size=256)}],
    "scale_batch": 8, "scale_seq": 32, "scale_warmup": 0, "scale_steps": 1,
    "squeeze": [0.8, 0.65],
    "timeouts": {"smoke": (120, 20), "smoke_torchrun": (90, 20), "hf_elixir": (90, 20), "fsdp2": (90, 20),
                 "deepspeed": (120, 20), "mfu": (90, 20), "scale": (90, 20), "recovery": (90, 20),
                 "disk_tier": (120, 20), "trainer": (150, 30), "trainer_compiled": (240, 60),
                 "long_context": (180, 30)},
    "cpu_adam_build_wait_s": 240,
    "smoke_archs": ["gpt2"], "smoke_plans": ["a_all_device", "d_all_cpu"],
    "disk_tier": {"quick": True},
    "trainer": {"model": TINY_GPT2, "batch": 2, "seq": 32, "warmup": 2, "steps": 3, "offloads": ["none"]},
    "trainer_compiled": {"model": TINY_GPT2, "batch": 2, "seq": 32, "warmup": 2, "steps": 3,
                         "offloads": ["none"], "target_vs_plain": 0.95},
    "long_context": {"model": {"name": "llama-tiny-long", "family": "llama",
                               "kwargs": dict(TINY_LLAMA, hidden_size=64, intermediate_size=128,
                                              max_position_embeddings=512)},
                     "lora_r": 8, "granule": 256, "start": 512, "limit": 512, "warmup": 1, "steps": 1},
}


class Runner:
    """Starts jobs in their own processes against one deadline."""

    def __init__(self, budget_s: float, workdir: Path, dry_run: bool, lanes: int = 1) -> None:
        self.deadline = time.monotonic() + budget_s
        self.lanes = lanes  # how many jobs may run at once (run_all, main's sections)
        self.workdir = workdir
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                        TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
                        PYTHONWARNINGS="ignore")
        if dry_run:  # CI shares few cores; tiny models gain nothing from threads
            self.env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        else:  # every system alike: a capped allocator should not fail on fragmentation
            self.env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.count = 0
        self._count_lock = threading.Lock()  # lanes > 1: jobs are started from several threads
        self.disk_path = workdir / "disk_tier"  # main() points it at the results' disk

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, job: dict, limits: tuple[float, float], torchrun: bool = False) -> dict:
        """Run one job within ``limits`` (most, least seconds); its result, or why there is
        none (timeout, killed, skipped: fewer than ``least`` seconds left)."""
        most, least = limits
        timeout = min(most, self.remaining())
        if timeout < least:
            return {"status": "skipped", "error": f"the suite's time budget is spent ({timeout:.0f} s left for it)"}
        with self._count_lock:
            self.count += 1
            out = self.workdir / f"job{self.count}.json"
        cmd = [sys.executable, str(JOBS), json.dumps(job), str(out)]
        if torchrun:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *cmd[1:]]
        t0 = time.monotonic()
        # a session of its own: on timeout the whole tree goes (torchrun's worker included),
        # so nothing keeps holding the GPU for the next job
        proc = subprocess.Popen(cmd, env=self.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"status": "timeout", "error": f"no result within {timeout:.0f} s", "wall_s": timeout}
        result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {
            "status": "killed" if proc.returncode < 0 else "error",
            "error": f"exit code {proc.returncode} without a result (killed for host memory?)",
            "stderr": stderr[-2000:]}
        result["wall_s"] = time.monotonic() - t0
        return result

    def run_all(self, calls: list[tuple[dict, tuple[float, float], bool]]) -> list[dict]:
        """``run`` for each (job, limits, torchrun) of jobs that do not depend on each other,
        ``lanes`` at a time; the results in the order of ``calls``."""
        if self.lanes <= 1:
            return [self.run(*call) for call in calls]
        with ThreadPoolExecutor(max_workers=self.lanes) as pool:
            return list(pool.map(lambda call: self.run(*call), calls))


class CpuAdamBuild:
    """DeepSpeed's CPU Adam, compiled on the machine the suite runs on (its torch, its
    compiler; a wheel built elsewhere carries no op, see ``benchmarks/gpu_wheels.sh``), in
    a process of its own while the smoke section runs, so DeepSpeed's offload baseline
    steps with its own optimizer rather than torch's. The offload section waits for it
    first: no compile runs beside a timed job."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.proc: Optional[subprocess.Popen] = None
        self.log = runner.workdir / "cpu_adam_build.log"
        self.started = 0.0
        self.result: dict[str, Any] = {"status": "unavailable", "error": "deepspeed is not installed"}

    def start(self) -> None:
        if not importlib.util.find_spec("deepspeed"):
            return
        code = ("from deepspeed.accelerator import get_accelerator; "
                "get_accelerator().create_op_builder('CPUAdamBuilder').load(verbose=False)")
        self.started = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=self.runner.env, cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def finish(self, timeout: float) -> dict:
        """Wait at most ``timeout`` seconds; on success the jobs are told the op is built."""
        if self.proc is None:
            return self.result
        try:
            code = self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            code = None
        seconds = time.monotonic() - self.started
        if code == 0:
            self.runner.env["HF_ELIXIR_DS_CPU_ADAM"] = f"compiled by the suite on this machine in {seconds:.0f} s"
            self.result = {"status": "ok", "seconds": seconds}
        else:
            tail = self.log.read_text()[-1500:] if self.log.exists() else ""
            self.result = {"status": "timeout" if code is None else "error", "seconds": seconds,
                           "error": f"no op after {seconds:.0f} s" if code is None else f"exit code {code}",
                           "log": tail}
        self.proc = None
        return self.result


def train_job(settings: dict, system: str, **extra) -> dict:
    job = {"job": "train", "system": system, "device": settings["device"], "model": settings["gpt2"],
           "batch": settings["batch"], "seq": settings["seq"], "dtype": settings["dtype"],
           "cap_bytes": settings["cap_bytes"], "warmup": 1, "steps": 3, "model_dtype": "fp32"}
    job.update(extra)
    return job


# ---------------------------------------------------------------------- sections
def section_smoke(runner: Runner, s: dict) -> dict:
    job = {"job": "smoke", "device": s["device"], "archs": s["smoke_archs"], "plans": s["smoke_plans"]}
    t = s["timeouts"]
    direct, launched = runner.run_all([(job, t["smoke"], False),
                                       (dict(job, torchrun=True, plans=["a_all_device", "d_all_cpu"]),
                                        t["smoke_torchrun"], True)])
    ok = direct.get("status") == "ok" and launched.get("status") == "ok"
    return {"status": "ok" if ok else "failed", "direct": direct, "torchrun": launched}


def section_offload(runner: Runner, s: dict) -> dict:
    t = s["timeouts"]
    return {
        "hf_elixir": runner.run(train_job(s, "hf_elixir"), t["hf_elixir"]),
        "fsdp2_offload": runner.run(train_job(s, "fsdp2", offload=True, checkpointing=True), t["fsdp2"]),
        "deepspeed_offload": runner.run(train_job(s, "deepspeed", checkpointing=True), t["deepspeed"])
        if importlib.util.find_spec("deepspeed") else
        {"status": "unavailable", "error": "deepspeed is not installed (pip install -e '.[bench]'; on a machine "
                                           "without network, carry the wheels of benchmarks/gpu_wheels.sh)"},
    }


def section_mfu(runner: Runner, s: dict) -> dict:
    t = s["timeouts"]["mfu"]
    return {
        "hf_elixir": runner.run(train_job(s, "hf_elixir", cap_bytes=None, mfu=True), t),
        "fsdp2": runner.run(train_job(s, "fsdp2", cap_bytes=None, mfu=True), t),
    }


def section_trainer(runner: Runner, s: dict) -> dict:
    """A stock Trainer script (benchmarks/trainer_speed.py) started plainly, then under
    ``hf-elixir launch`` with each offload setting (nothing offloaded first): each run's
    tokens/s and, for hf_elixir's, ``vs_plain`` (its tokens/s over the plain Trainer's)."""
    return trainer_runs(runner, s, "trainer", compile=False)


def section_trainer_compiled(runner: Runner, s: dict) -> dict:
    """The trainer section's script with ``--torch_compile true``, plain and under
    ``hf-elixir launch``: ``vs_plain`` is against the plain *compiled* Trainer, beside the
    target (``target_vs_plain``); ``meets_target`` only where the figures are a GPU's."""
    runs = trainer_runs(runner, s, "trainer_compiled", compile=True)
    target = s["trainer_compiled"]["target_vs_plain"]
    for name, r in runs.items():
        if "vs_plain" in r:
            r["target_vs_plain"] = target
            if s["device"] == "cuda":
                r["meets_target"] = r["vs_plain"] >= target
    return runs


def trainer_runs(runner: Runner, s: dict, key: str, compile: bool) -> dict:
    """trainer_speed.py plainly, then under ``hf-elixir launch`` with each offload setting of
    ``s[key]``, compiled or not; hf_elixir's tokens/s over the plain run's as ``vs_plain``."""
    t, limits = s[key], s["timeouts"][key]
    base = {"job": "trainer", "device": s["device"], "model": t["model"], "batch": t["batch"], "seq": t["seq"],
            "warmup": t["warmup"], "steps": t["steps"], "dtype": s["dtype"], "compile": compile}
    runs = {"plain": runner.run(dict(base, launcher="plain"), limits)}
    for offload in t["offloads"]:
        runs[f"hf_elixir_offload_{offload}"] = runner.run(dict(base, launcher="hf_elixir", offload=offload), limits)
    plain = runs["plain"]
    for name, r in runs.items():
        if name != "plain" and r.get("status") == "ok" and plain.get("status") == "ok":
            r["vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
    return runs


def section_scale(runner: Runner, s: dict) -> dict:
    """Bigger models until one fails (or time runs out); the largest success is the answer."""
    tried = []
    for spec in s["scale"]:
        job = train_job(s, "hf_elixir", model=spec, batch=s["scale_batch"], seq=s["scale_seq"],
                        warmup=s["scale_warmup"], steps=s["scale_steps"], model_dtype="bf16", split_batches=True,
                        cap_bytes=spec.get("cap_bytes", s["cap_bytes"]))
        result = runner.run(job, s["timeouts"]["scale"])
        tried.append({"model": spec["name"], **result})
        if result.get("status") != "ok":
            break
    ok = [r for r in tried if r.get("status") == "ok"]
    return {"largest": ok[-1]["model"] if ok else None, "tried": tried}


def section_recovery(runner: Runner, s: dict) -> dict:
    job = train_job(s, "hf_elixir", job="recovery", warmup=3, steps=3, squeeze=s["squeeze"])
    return runner.run(job, s["timeouts"]["recovery"])


def section_disk_tier(runner: Runner, s: dict) -> dict:
    """Half of the trainable chunks' optimizer state on disk against the host tier, on the
    device (bench_disk_tier.py); the tier's files under ``runner.disk_path``."""
    job = {"job": "disk_tier", "device": s["device"], "path": str(runner.disk_path), **s["disk_tier"]}
    return runner.run(job, s["timeouts"]["disk_tier"])


def section_long_context(runner: Runner, s: dict) -> dict:
    """A LoRA fine-tune at the longest sequence its plan allows under the cap, trained with
    that plan: measured peak and step against the plan's (issue 61)."""
    job = {"job": "long_context", "device": s["device"], "cap_bytes": s["cap_bytes"], "dtype": s["dtype"],
           **s["long_context"]}
    return runner.run(job, s["timeouts"]["long_context"])


#: the sections after the smoke test, the most telling first: what the deadline cuts is last
SECTIONS = {"offload_24g": section_offload, "trainer": section_trainer, "scale": section_scale, "mfu": section_mfu,
            "recovery": section_recovery, "disk_tier": section_disk_tier, "trainer_compiled": section_trainer_compiled,
            "long_context": section_long_context}


def not_run(name: str, why: str) -> Any:
    """A section's result, in its own shape, when it did not run."""
    skipped = {"status": "skipped", "error": why}
    return {"offload_24g": {k: skipped for k in ("hf_elixir", "fsdp2_offload", "deepspeed_offload")},
            "mfu": {k: skipped for k in ("hf_elixir", "fsdp2")},
            "trainer": {"plain": skipped}, "trainer_compiled": {"plain": skipped},
            "scale": {"largest": None, "tried": []}}.get(name, skipped)


def fidelity(results: dict) -> list[dict]:
    """Predicted against measured, for every hf_elixir run that has a plan."""
    rows = []
    runs = [("offload_24g", results.get("offload_24g", {}).get("hf_elixir", {}))]
    runs += [("scale", r) for r in results.get("scale", {}).get("tried", [])]
    for section, r in runs:
        plan = r.get("plan")
        if r.get("status") != "ok" or not plan:
            continue
        measured_peak = r.get("max_memory_allocated")
        source = "torch.cuda.max_memory_allocated"
        if measured_peak is None:  # CPU: the runtime's own accounting is what there is
            measured_peak, source = r.get("memory_report", {}).get("peak_total"), "memory_report() peak_total"
        rows.append({
            "section": section, "model": r.get("model"),
            "predicted_peak_bytes": plan["predicted_peak_bytes"], "measured_peak_bytes": measured_peak,
            "peak_source": source, "peak_ratio": _ratio(measured_peak, plan["predicted_peak_bytes"]),
            "predicted_step_s": plan["predicted_step_s"], "measured_step_s": r["median_step_s"],
            "step_ratio": _ratio(r["median_step_s"], plan["predicted_step_s"]),
        })
    return rows


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------- summary
def _gib(n: Optional[float]) -> str:
    return "" if n is None else f"{n / GiB:.1f}"


def summary_lines(results: dict) -> list[str]:
    lines = [f"hf_elixir GPU suite ({results['mode']}) on {results['environment'].get('gpu') or 'CPU'}: "
             f"{results['wall_s']:.0f} s",
             f"smoke: {results['smoke']['status']}"]
    for part in ("direct", "torchrun"):
        r = results["smoke"][part]
        lines.append(f"  {part:9s} {r.get('status')}  {len(r.get('checked', []))} cases"
                     + (f"  {r.get('failures') or r.get('error')}" if r.get("status") != "ok" else ""))
    build = results["environment"].get("deepspeed_cpu_adam_build") or {}
    if build.get("status") not in (None, "unavailable"):
        lines.append(f"deepspeed CPU Adam compiled here: {build['status']} ({build.get('seconds', 0):.0f} s)"
                     + (f"  {build.get('error')}" if build["status"] != "ok" else ""))
    lines.append(f"{'section':12s} {'system':18s} {'status':8s} {'tok/s':>9s} {'step s':>7s} {'peak GiB':>8s}  note")
    for section in ("offload_24g", "mfu"):
        for system, r in results.get(section, {}).items():
            note = r.get("optimizer", "") if r.get("status") == "ok" else r.get("error", "")
            if "mfu" in r:
                note = f"MFU {r['mfu']['mfu']:.1%}  " + note
            lines.append(f"{section:12s} {system:18s} {r.get('status', ''):8s} {r.get('tokens_per_s', 0):9.0f} "
                         f"{r.get('median_step_s', 0):7.3f} {_gib(r.get('max_memory_allocated')):>8s}  {note[:60]}")
    for section in ("trainer", "trainer_compiled"):
        for name, r in results.get(section, {}).items():
            note = (f"{r['trainer']}, {r['batch']} x {r['seq']}" + (f", {r['vs_plain']:.2f}x the plain Trainer"
                                                                    if "vs_plain" in r else "")
                    + (f" (target {r['target_vs_plain']:.2f}x)" if "target_vs_plain" in r else "")
                    if r.get("status") == "ok" else r.get("error", ""))
            label = section if section == "trainer" else "compiled"
            lines.append(f"{label:12s} {name[:18]:18s} {r.get('status', ''):8s} {r.get('tokens_per_s', 0):9.0f} "
                         f"{r.get('median_step_s', 0):7.3f} {'':>8s}  {note[:70]}")
    for r in results.get("scale", {}).get("tried", []):
        plan = r.get("plan") or {}
        note = (f"offload {plan.get('offload_fraction', 0):.0%}, params on host {plan.get('param_offload', 0)} chunks"
                + (f", {plan['micro_batch_split']} micro-batches" if plan.get("micro_batch_split", 1) > 1 else "")
                if r.get("status") == "ok" else r.get("error", ""))
        lines.append(f"{'scale':12s} {str(r['model'])[:18]:18s} {r.get('status', ''):8s} {r.get('tokens_per_s', 0):9.0f} "
                     f"{r.get('median_step_s', 0):7.3f} {_gib(r.get('max_memory_allocated')):>8s}  {note[:60]}")
    r = results.get("recovery", {})
    if r:
        events = r.get("events") or []
        changes = ", ".join(e["change"] for e in events if e.get("change")) or r.get("error", "")[:60]
        caps = "/".join(f"{q['fraction_of_peak']:.0%}" for q in r.get("squeezes") or [])
        lines.append(f"{'recovery':12s} {'hf_elixir':18s} {r.get('status', ''):8s} "
                     f"{r.get('tokens_per_s_after') or 0:9.0f} {r.get('recovery_step_s') or 0:7.3f} "
                     f"{_gib(r.get('squeezed_to_bytes')):>8s}  caps {caps or '-'} of the peak: "
                     f"{len(events)} failure(s); {changes[:40]}")
    r = results.get("disk_tier", {})
    if r:
        if r.get("status") in ("ok", "failed"):
            d = r["disk"]
            lines.append(f"{'disk_tier':12s} {'hf_elixir':18s} {r['status']:8s} disk read {d['read_MBps']:.0f} MB/s, "
                         f"write {d['write_MBps']:.0f} MB/s; step disk/host {r['step_ratio_disk_to_host']:.2f} "
                         f"({r['median_step_s']['disk_half']:.3f} s / {r['median_step_s']['host']:.3f} s)")
            lines.append(f"  {r['disk_chunks']} of {r['n_chunks']} chunks on disk: "
                         f"{r['read_bytes_per_step'] / 1e6:.0f} MB read + {r['written_bytes_per_step'] / 1e6:.0f} MB "
                         f"written a step at {r['io_efficiency'] or 0:.2f}x the measured bandwidth; weights "
                         f"bit-identical {r['weights_match_host']}, losses {r['losses_match_host']}")
        else:
            lines.append(f"{'disk_tier':12s} {'hf_elixir':18s} {r.get('status', ''):8s} {r.get('error', '')[:60]}")
    r = results.get("long_context", {})
    if r:
        if r.get("status") == "ok":
            plan = r["plan"]
            lines.append(f"{'long_ctx':12s} {str(r['model'])[:18]:18s} ok       {r['tokens_per_s']:9.0f} "
                         f"{r['median_step_s']:7.3f} {_gib(r['measured_peak_bytes']):>8s}  {r['seq_len']} tokens, "
                         f"peak measured/predicted {r['peak_ratio'] or 0:.2f}, step {r['step_ratio'] or 0:.2f}, "
                         f"policies {plan['block_policies'] or '-'}, logit pieces {plan['logit_piece_tokens']}")
        else:
            lines.append(f"{'long_ctx':12s} {str(r.get('model', ''))[:18]:18s} {r.get('status', ''):8s} "
                         f"{str(r.get('error', ''))[:60]}")
    for row in results.get("fidelity", []):
        lines.append(f"fidelity {row['section']:11s} peak measured/predicted {row['peak_ratio'] or 0:.2f}, "
                     f"step {row['step_ratio'] or 0:.2f}  ({row['peak_source']})")
    lines += breakdown_lines(results)
    return lines


def breakdown_lines(results: dict) -> list[str]:
    """Each hf_elixir run's measured step by phase beside its plan's prediction
    (``ElixirModule.time_report()``, runtime/timing.py)."""
    from hf_elixir.runtime.timing import format_report

    runs = [(section, results.get(section, {}).get("hf_elixir", {})) for section in ("offload_24g", "mfu")]
    runs += [("scale", r) for r in results.get("scale", {}).get("tried", [])]
    runs += [(section, r) for section in ("trainer", "trainer_compiled")
             for name, r in results.get(section, {}).items() if name != "plain"]
    lines = []
    for section, r in runs:
        report = r.get("time_report")
        if r.get("status") == "ok" and report:
            lines.append(f"breakdown {section} {r.get('model')}:")
            lines += ["  " + line for line in format_report(report).splitlines()]
    return lines


def environment() -> dict:
    """Versions; the GPU's name comes from the smoke job (querying it here would create a
    CUDA context in this process, holding device memory for the whole run)."""
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for package in ("transformers", "accelerate", "deepspeed"):
        try:
            from importlib.metadata import version

            env[package] = version(package)
        except Exception:
            env[package] = None
    return env


def run_sections(runner: Runner, settings: dict, chosen: list[str], results: dict, save: Callable[[], None]) -> None:
    """The sections after the smoke test into ``results`` (in ``SECTIONS`` order), saved as
    each ends: one after the other, or ``runner.lanes`` at a time in the same order of starting."""
    ended: dict[str, Any] = {}
    for name in SECTIONS:
        if results["smoke"]["status"] != "ok":
            ended[name] = not_run(name, "the smoke test failed")
        elif name not in chosen:
            ended[name] = not_run(name, "not among --sections")
    with ThreadPoolExecutor(max_workers=max(1, runner.lanes)) as pool:
        running = {pool.submit(SECTIONS[name], runner, settings): name for name in SECTIONS if name not in ended}
        for done in as_completed(running):
            ended[running[done]] = done.result()
            results[running[done]] = ended[running[done]]  # a run cut short keeps what ended
            save()
    for name in SECTIONS:  # the file lists them in SECTIONS order, whichever ended first
        results.pop(name, None)
        results[name] = ended[name]
    save()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models: every step, nothing measured")
    p.add_argument("--out", type=Path, default=None, help=f"results JSON (default {RESULTS.relative_to(ROOT)}; "
                   "a dry run: a temporary file)")
    p.add_argument("--budget", type=float, default=None, help="seconds the whole suite may take")
    p.add_argument("--disk-path", type=Path, default=None,
                   help="where the disk_tier section's scratch directory goes (default: beside --out)")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                   help="the sections to run after the smoke test, in their own order (default: all; a "
                        "second call can run what the first one's deadline cut)")
    args = p.parse_args(argv)
    settings = DRY_SETTINGS if args.dry_run else GPU_SETTINGS
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to check the script on a CPU", file=sys.stderr)
            return 2
    out = args.out or (Path(tempfile.gettempdir()) / "gpu_suite_dry_run.json" if args.dry_run else RESULTS)
    start = time.monotonic()
    results: dict[str, Any] = {"mode": "dry-run (CPU, tiny models: no figure here is a GPU measurement)"
                               if args.dry_run else "gpu", "environment": environment(),
                               "settings": {k: v for k, v in settings.items() if k != "timeouts"}}
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section: a run cut short keeps what it measured
        results["wall_s"] = time.monotonic() - start
        out.write_text(json.dumps(results, indent=1, default=str))

    disk_root = args.disk_path or out.parent
    disk_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as tmp, \
            tempfile.TemporaryDirectory(prefix=".gpu_suite_disk_tier_", dir=disk_root) as disk_tmp:
        runner = Runner(args.budget or settings["budget_s"], Path(tmp), args.dry_run, settings["lanes"])
        runner.disk_path = Path(disk_tmp)
        results["environment"]["PYTORCH_CUDA_ALLOC_CONF"] = runner.env.get("PYTORCH_CUDA_ALLOC_CONF")
        cpu_adam = CpuAdamBuild(runner)
        if "offload_24g" in args.sections:
            cpu_adam.start()
        results["smoke"] = section_smoke(runner, settings)
        results["environment"]["deepspeed_cpu_adam_build"] = cpu_adam.finish(settings["cpu_adam_build_wait_s"])
        for key in ("gpu", "gpu_memory_bytes"):
            results["environment"][key] = results["smoke"]["direct"].get(key)
        save()
        run_sections(runner, settings, args.sections, results, save)
    results["fidelity"] = fidelity(results)
    save()
    print("\n".join(summary_lines(results)))
    print(f"wrote {out}")
    jobs = [r for sec in ("offload_24g", "mfu", "trainer", "trainer_compiled") for r in results[sec].values()]
    jobs += results["scale"]["tried"]
    jobs.append(results["recovery"])
    jobs.append(results["disk_tier"])
    # the disk tier's results differing from the host tier's is a failure, as the smoke test's
    failed = (results["smoke"]["status"] != "ok" or results["disk_tier"].get("status") == "failed"
              or any(r.get("status") == "error" for r in jobs))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
