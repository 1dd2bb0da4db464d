"""One job of the GPU suite, in a process of its own (see gpu_suite.py, which starts them).

    python benchmarks/gpu_suite_jobs.py '<job JSON>' result.json

A job is a JSON object with a ``job`` key:

- ``smoke``: the equivalence recipe of tests/equivalence.py on the compute device at world
  size 1: every kind of plan in fp32 against plain PyTorch on the same device, and bf16
  against the fp32 reference (losses within 2%). Under torchrun it joins the launcher's
  process group first (NCCL on CUDA, gloo on CPU).
- ``train``: one system (hf_elixir with its planned plan, FSDP2 with or without
  CPUOffloadPolicy, DeepSpeed ZeRO-3 with optimizer and parameter offload) trains a model
  for warm-up + timed steps under an optional memory cap; tokens/s, peak allocated memory
  and, for hf_elixir, the plan's predictions are recorded.
- ``trainer``: ``benchmarks/trainer_speed.py``, a stock Trainer script that times its own
  steps, started plainly or under ``hf-elixir launch`` with a one-process config (its
  ``offload`` setting from the job), with ``--torch_compile true`` where the job has
  ``compile``; the script's result.
- ``disk_tier``: ``benchmarks/bench_disk_tier.py`` on the compute device (its ``disk_half``
  and ``host`` systems, in ranks of their own, the tier's files under the job's ``path``):
  the disk's measured bandwidth, one step's disk traffic against it, the step time with
  half of the trainable chunks' optimizer state on disk over the host tier's, and whether
  the two trained to the same weights and losses bit for bit.

- ``long_context``: a Llama-style LoRA fine-tune (bf16, batch 1; issue 61) at the longest
  sequence the plan allows under the job's cap (``planner/longest.py``, each probe a whole
  plan of the PEFT model, as ``hf-elixir plan --seq-len max --lora-r N`` makes it), trained
  for warm-up + timed steps with that plan (its block policies and logit pieces); the
  measured peak (``torch.cuda.max_memory_allocated``; on a CPU the runtime's
  ``memory_report()["peak_total"]``) and median step against the plan's predictions.

The result (always a JSON object with ``status``: ok, oom, infeasible (no plan fits), failed,
error) is written to
the result path, so a crash after that point loses nothing; an out-of-memory error is a
result, not a failure of the job.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from bench_step import blocks_of, elixir_step, plain_step

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
GiB = 2**30


# ---------------------------------------------------------------------- device and models
def device_and_cap(job: dict) -> torch.device:
    """The compute device; with a CUDA device, cap this process's allocations as a smaller
    card would (``cap_bytes``), so an over-large run fails with an out-of-memory error."""
    if job.get("device", "cuda") == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(index)
    cap = job.get("cap_bytes")
    if cap:
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
    torch.cuda.reset_peak_memory_stats(index)
    return torch.device("cuda", index)


def make_config(spec: dict):
    """A transformers config: ``{"known": name}`` (hf_elixir's table of published configs)
    or ``{"family": "gpt2"|"llama", "kwargs": {...}}``."""
    import transformers as tf

    from hf_elixir.profile.configs import known_config

    if "known" in spec:
        cfg = known_config(spec["known"])
    else:
        cls = {"gpt2": tf.GPT2Config, "llama": tf.LlamaConfig}[spec["family"]]
        cfg = cls(**spec["kwargs"])
    cfg.use_cache = False
    return cfg


def build_model(spec: dict, dtype: torch.dtype) -> nn.Module:
    """The model with its parameters filled by one fast pass (uniform, as small as a normal
    init's spread) instead of Hugging Face's initialisation: a 7B model initialises in
    seconds, not minutes. Buffers (rotary frequencies) are built normally. Every system
    gets the same values."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    cfg = make_config(spec)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    torch.manual_seed(0)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:  # tied parameters stay one parameter
                t = torch.empty(p.shape, dtype=dtype)
                if p.dim() >= 2:
                    t.uniform_(-0.02, 0.02)
                else:
                    t.fill_(0.0 if name == "bias" else 1.0)
                made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    model.tie_weights()  # on the meta device the tie (GPT-2's wte and lm_head) was not made yet
    return model


def enable_checkpointing(model: nn.Module) -> None:
    """The baselines checkpoint activations the way hf_elixir's plan does (the model's own
    switch, non-reentrant)."""
    from hf_elixir.profile.profiler import enable_checkpointing as enable

    enable(model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_group(device: torch.device) -> None:
    """FSDP2 and DeepSpeed need a process group even for one rank."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


# ---------------------------------------------------------------------- systems
def setup_hf_elixir(model, job: dict, device: torch.device) -> tuple[Callable, dict]:
    """hf_elixir with the plan the planner picks for this model, batch and memory cap."""
    import hf_elixir as hfe

    plan = job["_plan"]
    em = hfe.ElixirModule(model, plan, device=device)
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def info() -> dict:
        report = em.memory_report()
        # the warm-up step records the trace: the breakdown is the mean of the timed steps
        return {"memory_report": {k: report[k] for k in ("peak", "peak_total", "current_total")},
                "cache_stats": report["cache_stats"], "time_report": em.time_report()}

    step = elixir_step(em, opt) if plan.micro_batch_split == 1 else accumulating_step(em, opt, plan.micro_batch_split)
    return step, {"optimizer": "ElixirOptimizer (torch AdamW kernels)", "info": info}


def accumulating_step(em, opt, split: int) -> Callable:
    """One optimizer step over a batch run as ``split`` micro-batches (the plan's split):
    each micro-batch's mean loss divided by ``split``, so the gradient is the batch's."""

    def step(ids):
        total = 0.0
        for part in ids.chunk(split):
            loss = em(input_ids=part, labels=part).loss
            opt.backward(loss / split)
            total = total + loss.detach()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return total / split

    return step


def setup_fsdp2(model, job: dict, device: torch.device) -> tuple[Callable, dict]:
    """FSDP2 per layer and at the root, bf16 compute with fp32 reduction; with ``offload``
    its CPUOffloadPolicy (the optimizer then steps on the CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    init_single_process_group(device)
    if job.get("checkpointing"):
        enable_checkpointing(model)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[job["dtype"]]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if job.get("offload") else OffloadPolicy()
    for block in blocks_of(model):
        fully_shard(block, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mp_policy=mp, offload_policy=policy)
    step = plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    return (lambda ids: step(ids.to(device))), {"optimizer": "torch.optim.AdamW(fused=True)"}


def deepspeed_cpu_adam() -> tuple[bool, str]:
    """Whether DeepSpeedCPUAdam is ready without compiling, and what was found: an op built
    into the installed package, or one the suite compiled before this job (gpu_suite.py's
    ``CpuAdamBuild``, which says so in ``HF_ELIXIR_DS_CPU_ADAM``). A job never compiles it
    itself: that would take a minute or more inside a timed run."""
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception as exc:  # deepspeed missing or broken
        return False, f"deepspeed not importable ({exc!r})"
    if installed_ops.get("cpu_adam"):
        return True, "DeepSpeedCPUAdam (prebuilt op)"
    if os.environ.get("HF_ELIXIR_DS_CPU_ADAM"):
        return True, f"DeepSpeedCPUAdam ({os.environ['HF_ELIXIR_DS_CPU_ADAM']})"
    missing = [what for what, ok in (("CUDA_HOME", os.environ.get("CUDA_HOME")),
                                     ("a C++ compiler", shutil.which("c++") or shutil.which("g++"))) if not ok]
    why = f"missing {', '.join(missing)}" if missing else "it would be JIT-compiled (minutes)"
    return False, f"DeepSpeedCPUAdam not prebuilt, {why}: fused torch AdamW used instead"


def setup_deepspeed(model, job: dict, device: torch.device) -> tuple[Callable, dict]:
    """DeepSpeed ZeRO-3 with optimizer and parameter offload to the CPU."""
    import deepspeed

    init_single_process_group(device)
    if device.type == "cpu":
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce (a minute, on
        # a fresh machine) as its backend starts; one process never uses it
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    if job.get("checkpointing"):
        enable_checkpointing(model)
    pin = device.type == "cuda"
    h = model.config.hidden_size  # the bucket sizes Hugging Face's integration picks for "auto"
    zero = {"stage": 3, "reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "offload_optimizer": {"device": "cpu", "pin_memory": pin},
            "offload_param": {"device": "cpu", "pin_memory": pin}}
    ready, note = deepspeed_cpu_adam()
    if ready:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    config = {"train_micro_batch_size_per_gpu": job["batch"], "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": {"enabled": job["dtype"] == "bf16"},
              "zero_optimization": zero, "zero_force_ds_cpu_optimizer": ready,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(ids):
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step, {"optimizer": note}


SYSTEMS = {"hf_elixir": setup_hf_elixir, "fsdp2": setup_fsdp2, "deepspeed": setup_deepspeed}


# ---------------------------------------------------------------------- jobs
def model_flops(cfg, tokens: int, seq: int) -> float:
    """Model FLOPs of one training step (forward and backward, no recomputation): 6 per
    parameter per token plus attention's 12 * layers * hidden * sequence per token."""
    n_layer = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    hidden = cfg.hidden_size
    return tokens * (6 * job_params(cfg) + 12 * n_layer * hidden * seq)


def job_params(cfg) -> int:
    """Trainable parameters of ``cfg``'s model, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def plan_for(job: dict, device: torch.device):
    """hf_elixir's plan for this job, from the config alone (fails fast, before any memory
    is touched, when nothing fits). With ``split_batches`` a batch that does not fit runs as
    micro-batches: the largest that divides it and fits, as the Trainer's
    ``auto_find_batch_size`` does (``plan_split``), so the tokens of a step stay the job's."""
    import hf_elixir as hfe
    from hf_elixir.integrations.planning import plan_split

    hw = hfe.HardwareProfile.detect()
    budget = job.get("cap_bytes") or None
    cfg = make_config(job["model"])

    def searched(shape: tuple[int, int]):
        return hfe.plan(cfg, shape, hardware=hw, world_size=1, dtype=job["dtype"], memory_budget=budget)

    try:
        return searched((job["batch"], job["seq"])), hw
    except hfe.PlanError as error:
        if not job.get("split_batches"):
            raise
        return plan_split(searched, (job["batch"], job["seq"]), error), hw


def predicted_batch_step(plan) -> float:
    """The plan's step time for a whole batch: its prediction is for one micro-batch's step,
    and each further micro-batch adds one more forward and backward (the optimizer steps
    once), as the planner prices a split (``planner/levers.split_priced``)."""
    time = plan.predictions.get("time", {})
    return plan.predictions["step_time_s"] + (plan.micro_batch_split - 1) * time.get("forward_backward", 0.0)


def run_train(job: dict) -> dict:
    device = device_and_cap(job)
    out: dict[str, Any] = {"system": job["system"], "model": job["model"].get("name"), "device": str(device)}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    if job["system"] == "hf_elixir":
        import hf_elixir as hfe

        t0 = time.perf_counter()
        try:
            job["_plan"], hw = plan_for(job, device)
        except hfe.PlanError as exc:  # an answer (the model is too large here), not a failure
            return dict(out, status="infeasible", error=str(exc)[:600])
        preds = job["_plan"].predictions
        out["plan"] = {"seconds": time.perf_counter() - t0, "summary": job["_plan"].summary(),
                       "predicted_peak_bytes": preds.get("peak_bytes"),
                       "predicted_step_s": predicted_batch_step(job["_plan"]),
                       "micro_batch_split": job["_plan"].micro_batch_split,
                       "n_chunks": job["_plan"].n_chunks, "chunk_size": job["_plan"].chunk_size,
                       "offload_fraction": job["_plan"].offload_fraction(),
                       "param_offload": sum(c.param_placement == "cpu" for c in job["_plan"].chunks),
                       "rcache_blocks": job["_plan"].rcache_blocks,
                       "activation_checkpointing": job["_plan"].activation_checkpointing,
                       "hardware": hw.name}
    dtype = torch.bfloat16 if job.get("model_dtype") == "bf16" else torch.float32
    t0 = time.perf_counter()
    model = build_model(job["model"], dtype)
    out["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    step, meta = SYSTEMS[job["system"]](model, job, device)
    out["setup_s"] = time.perf_counter() - t0
    out["optimizer"] = meta["optimizer"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab = model.config.vocab_size
    times, losses = [], []
    for i in range(job["warmup"] + job["steps"]):
        ids = torch.randint(0, vocab, (job["batch"], job["seq"]), generator=torch.Generator().manual_seed(i))
        sync()
        t0 = time.perf_counter()
        loss = step(ids)
        sync()
        elapsed = time.perf_counter() - t0
        losses.append(float(loss.detach().float().cpu()))
        if i >= job["warmup"]:
            times.append(elapsed)
    median = statistics.median(times)
    tokens = job["batch"] * job["seq"]
    out.update(status="ok", step_times_s=times, median_step_s=median, tokens_per_s=tokens / median,
               losses=losses, finite=all(l == l and abs(l) != float("inf") for l in losses))
    if device.type == "cuda":
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    if job.get("mfu"):
        import hf_elixir as hfe

        hw = hfe.HardwareProfile.detect()
        peak = hw.matmul_flops["bfloat16" if job["dtype"] == "bf16" else "float32"]
        flops = model_flops(model.config, tokens, job["seq"])
        out["mfu"] = {"model_flops_per_step": flops, "peak_flops": peak, "hardware": hw.name,
                      "peak_source": hw.sources.get("matmul_flops", "preset"),
                      "mfu": flops / median / peak if peak > 0 else None}
    if "info" in meta:
        out.update(meta["info"]())
    return out


def run_recovery(job: dict) -> dict:
    """Out-of-memory recovery on the device: train ``warmup`` steps with the planned plan,
    then take memory away until a step really fails: cap allocations at each fraction of
    ``squeeze`` in turn (of the peak the warm-up steps reached), one step at each, and stop
    at the first step that ran out of memory and recovered (or could not). On a CPU, where
    no cap exists, an injected error at the first squeezed step stands in for it. Then
    ``steps - 1`` more steps at that cap. Records each cap tried, what failed, what the
    runtime changed, the wall time of the step that recovered, and the throughput before
    and after."""
    import hf_elixir as hfe

    device = device_and_cap(dict(job, cap_bytes=None))
    out: dict[str, Any] = {"system": "hf_elixir", "model": job["model"].get("name"), "device": str(device)}
    try:
        plan, _ = plan_for(job, device)
    except hfe.PlanError as exc:
        return dict(out, status="infeasible", error=str(exc)[:600])
    if device.type == "cpu":
        os.environ["ELIXIR_INJECT_OOM"] = f"{job['warmup']}:forward"
    model = build_model(job["model"], torch.float32)
    em = hfe.ElixirModule(model, plan, device=device)
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-4))
    step = elixir_step(em, opt)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab, tokens = model.config.vocab_size, job["batch"] * job["seq"]
    out["plan"] = {"rcache_blocks": plan.rcache_blocks, "activation_checkpointing": plan.activation_checkpointing,
                   "predicted_peak_bytes": plan.predictions.get("peak_bytes")}
    times: list[float] = []
    out["squeezes"] = squeezes = []

    def timed(i: int) -> float:
        ids = torch.randint(0, vocab, (job["batch"], job["seq"]), generator=torch.Generator().manual_seed(i))
        sync()
        t0 = time.perf_counter()
        step(ids)
        sync()
        times.append(time.perf_counter() - t0)
        return times[-1]

    events = em.recovery.log.events
    try:
        for i in range(job["warmup"]):
            timed(i)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        out["peak_before_bytes"] = peak
        recovered_at = None
        for fraction in job["squeeze"] if device.type == "cuda" else job["squeeze"][:1]:
            before = len(events)
            if peak is not None:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, fraction * peak / total), device)
                out["squeezed_to_bytes"] = fraction * peak
            seconds = timed(len(times))
            squeezes.append({"fraction_of_peak": fraction, "cap_bytes": fraction * peak if peak else None,
                             "failures": len(events) - before, "step_s": seconds})
            if len(events) > before:
                recovered_at = len(times) - 1
                break
        for _ in range(job["steps"] - 1 if recovered_at is not None else 0):
            timed(len(times))
    except hfe.RecoveryFailed as exc:
        return dict(out, status="not_recovered", error=str(exc)[:600], events=events, step_times_s=times)
    if recovered_at is None:
        return dict(out, status="no_failure", events=events, step_times_s=times,
                    error=f"no step ran out of memory, down to {job['squeeze'][-1]:.0%} of the peak")
    before, after = times[1:job["warmup"]] or times[:1], times[recovered_at + 1:]
    out.update(status="ok", events=events, step_times_s=times, recovery_step_s=times[recovered_at],
               tokens_per_s_before=tokens / statistics.median(before),
               tokens_per_s_after=tokens / statistics.median(after) if after else None,
               plan_after={"rcache_blocks": em.plan.rcache_blocks,
                           "activation_checkpointing": em.plan.activation_checkpointing,
                           "recovery": em.plan.predictions.get("recovery")})
    return out


def run_trainer(job: dict) -> dict:
    """``trainer_speed.py`` (a stock Trainer script) started as a user starts it: plainly
    (``launcher: plain``), or under ``hf-elixir launch`` with a one-process config whose
    elixir section sets ``offload`` (``launcher: hf_elixir``); compiled (the Trainer's
    ``torch_compile``) where ``compile`` is set. Its result, with the command's wall time."""
    with tempfile.TemporaryDirectory(prefix="trainer_speed_") as tmp:  # removed on every path
        return _trainer_in(job, Path(tmp))


def _trainer_in(job: dict, work: Path) -> dict:
    """``run_trainer``'s run, its config, result and output folder in ``work``."""
    script = HERE / "trainer_speed.py"
    spec = job["model"]["kwargs"]
    out = work / "result.json"
    script_args = [str(script), "--out", str(out), "--layers", str(spec["n_layer"]), "--width", str(spec["n_embd"]),
                   "--heads", str(spec["n_head"]), "--vocab", str(spec["vocab_size"]), "--seq", str(job["seq"]),
                   "--timed_steps", str(job["steps"]), "--untimed_steps", str(job["warmup"]),
                   "--per_device_train_batch_size", str(job["batch"]), "--bf16", str(job["dtype"] == "bf16").lower(),
                   "--output_dir", str(work / "out"), "--save_strategy", "no", "--logging_strategy", "no",
                   "--report_to", "none", "--disable_tqdm", "true"]
    cpu = job["device"] == "cpu"
    if cpu:  # a bf16 Trainer on a CPU is told so
        script_args += ["--use_cpu", "true"]
    if job.get("compile"):  # as a user asks for it: the Trainer's own flag
        script_args += ["--torch_compile", "true"]
    if job["launcher"] == "plain":
        cmd = [sys.executable, *script_args]
    else:
        config = work / "elixir.yaml"
        cli = [sys.executable, "-m", "hf_elixir.cli"]
        made = subprocess.run([*cli, "config", "--non-interactive", "--config_file", str(config), "--num_processes", "1",
                               "--mixed_precision", "bf16" if job["dtype"] == "bf16" else "no",
                               "--offload", job["offload"], *(["--use_cpu"] if cpu else [])],
                              capture_output=True, text=True)
        if made.returncode != 0:
            return {"status": "error", "error": f"hf-elixir config failed: {made.stderr[-600:]}"}
        cmd = [*cli, "launch", "--config_file", str(config), "--main_process_port", str(free_port()), *script_args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        return {"status": "error", "error": f"exit code {proc.returncode}", "stderr": proc.stderr[-3000:],
                "command_s": wall}
    return dict(json.loads(out.read_text()), status="ok", model=job["model"].get("name"), launcher=job["launcher"],
                offload=job.get("offload"), command_s=wall)


def run_disk_tier(job: dict) -> dict:
    """bench_disk_tier.py in a subprocess (its ranks are spawned: a timeout of this job's
    process group takes them too), sized by the job; the figures the suite keeps."""
    import subprocess
    import tempfile

    path = Path(job["path"])
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="disk_tier_out_") as tmp:
        out_json = Path(tmp) / "bench_disk_tier.json"
        cmd = [sys.executable, str(HERE / "bench_disk_tier.py"), "--device", job["device"], "--path", str(path),
               "--out", str(out_json), "--systems", "disk_half", "host"]
        if job.get("quick"):
            cmd.append("--quick")
        for key in ("width", "layers", "layers_per_chunk", "warmup", "steps", "disk_total"):
            if job.get(key) is not None:
                cmd += [f"--{key.replace('_', '-')}", str(job[key])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out_json.exists():
            return {"status": "error", "error": f"bench_disk_tier.py exited {proc.returncode}",
                    "stderr": proc.stderr[-2000:], "stdout": proc.stdout[-1000:]}
        data = json.loads(out_json.read_text())
    rows, disk = data["systems"], data["disk"]
    half, host = rows["disk_half"], rows["host"]
    traffic = half["traffic"]
    match = bool(half.get("weights_match_host")) and bool(half.get("losses_match_host"))
    return {
        "status": "ok" if match else "failed", "device": half.get("device"), "config": data["config"],
        "disk": {"read_MBps": disk["read_bytes_per_s"] / 1e6, "write_MBps": disk["write_bytes_per_s"] / 1e6,
                 "block_bytes": disk["before"]["block_bytes"], "direct": disk["before"]["direct"],
                 "before": disk["before"], "after": disk["after"]},
        "n_chunks": half["n_chunks"], "disk_chunks": half["disk_chunks"],
        "disk_state_bytes": half.get("disk_state_bytes"),
        "median_step_s": {"disk_half": half["median_step_s"], "host": host["median_step_s"]},
        "step_times_s": {"disk_half": half["step_s"], "host": host["step_s"]},
        "step_ratio_disk_to_host": half["step_ratio_to_host"],
        "read_bytes_per_step": traffic["read_bytes_per_step"],
        "written_bytes_per_step": traffic["written_bytes_per_step"],
        "io_efficiency": traffic["io_efficiency"], "traffic": traffic,
        "weights_match_host": half.get("weights_match_host"), "losses_match_host": half.get("losses_match_host"),
        "max_memory_allocated": {k: r.get("max_memory_allocated") for k, r in (("disk_half", half), ("host", host))},
        "files_left": data["files_left"],
    }


def run_smoke(job: dict) -> dict:
    """The equivalence recipe on the compute device: fp32 plans against plain PyTorch on
    the same device, bf16 against the fp32 reference's losses."""
    sys.path.insert(0, str(TESTS))
    import warnings

    from equivalence import PLANS, assert_matches, build, chunk_size_for, elixir_run, reference_run

    warnings.filterwarnings("ignore")
    if job.get("torchrun"):
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() and job.get("device") != "cpu" else "gloo"
        dist.init_process_group(backend)
    device = device_and_cap(job)
    # cuBLAS picks kernels by shape and the recipe splits the batch into micro-batches, so on
    # a GPU the fp32 runs agree to float rounding of a few 1e-6, not bit for bit
    rtol = 1e-5 if device.type == "cpu" else 1e-4
    checked, failures = [], []
    for arch in job["archs"]:
        size = max(chunk_size_for(build(arch)), 4096)
        ref = reference_run(arch, device=str(device))
        for name in job["plans"]:
            kw = dict(PLANS[name], chunk_size=size)
            label = f"{arch}/{name}/fp32"
            try:
                assert_matches(ref, elixir_run(0, 1, arch, kw, device=str(device)), rtol=rtol, label=label)
            except AssertionError as exc:
                failures.append(str(exc))
            checked.append(label)
        got = elixir_run(0, 1, arch, dict(PLANS["c_half_optim_cpu"], chunk_size=size, compute_dtype="bf16"),
                         device=str(device))
        far = [(a, b) for a, b in zip(ref["losses"], got["losses"]) if abs(a - b) > 0.02 * abs(a)]
        checked.append(f"{arch}/c_half_optim_cpu/bf16")
        if far:
            failures.append(f"{arch} bf16: losses beyond 2% of fp32: {far}")
    if job.get("torchrun"):
        import torch.distributed as dist

        out_backend = dist.get_backend()
        dist.destroy_process_group()
    else:
        out_backend = None
    out = {"status": "failed" if failures else "ok", "device": str(device), "checked": checked,
           "failures": failures, "backend": out_backend}
    if device.type == "cuda":
        out.update(gpu=torch.cuda.get_device_name(device),
                   gpu_memory_bytes=torch.cuda.get_device_properties(device).total_memory)
    return out


def lora_of(model: nn.Module, r: int) -> nn.Module:
    """The PEFT fine-tune the planner's ``meta_lora_model`` describes: the same targets
    (``default_lora_targets``), ``lora_alpha`` 2 r, no dropout; the base frozen."""
    from peft import LoraConfig, get_peft_model

    from hf_elixir.profile.lora import default_lora_targets

    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=default_lora_targets(model), lora_dropout=0.0)
    return get_peft_model(model, config)


def run_long_context(job: dict) -> dict:
    """The longest sequence whose plan fits the cap, then that plan trained (see the module
    docstring): the plan's block policies, logit pieces and predictions beside the measured
    peak and step time."""
    import hf_elixir as hfe
    from hf_elixir.planner.longest import longest_sequence, probe_with
    from hf_elixir.profile import profile_model
    from hf_elixir.profile.lora import meta_lora_model

    device = device_and_cap(job)
    out: dict[str, Any] = {"model": job["model"].get("name"), "device": str(device), "lora_r": job["lora_r"]}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    hw = hfe.HardwareProfile.detect()
    cfg = make_config(job["model"])
    budget = job.get("cap_bytes") or hw.device_memory

    def plan_at(seq: int):
        prof = profile_model(cfg, (1, seq), dtype=job["dtype"], attention_target=device.type,
                             build=lambda c: meta_lora_model(c, job["lora_r"], dtype=job["dtype"]))
        return hfe.plan(cfg, (1, seq), hardware=hw, world_size=1, dtype=job["dtype"], memory_budget=budget,
                        profile=prof, efficiency="calibrated")

    t0 = time.perf_counter()
    found = longest_sequence(probe_with(plan_at), budget, granule=job["granule"], start=job["start"],
                             limit=job["limit"])
    out["probes"] = [{"seq_len": p.seq_len, "fits": p.fits} for p in found.probes]
    out["plan_s"] = time.perf_counter() - t0
    if found.best is None:  # an answer (nothing fits this cap), not a failure
        return dict(out, status="infeasible", error=found.beyond.error[:600] if found.beyond else "no probe")
    plan, seq = found.best.plan, found.best.seq_len
    policies = list(plan.block_policies.values()) if plan.block_policies else []
    out["plan"] = {"seq_len": seq, "summary": plan.summary(),
                   "predicted_peak_bytes": plan.predictions.get("peak_bytes"),
                   "predicted_step_s": predicted_batch_step(plan), "logit_piece_tokens": plan.logit_piece_tokens,
                   "block_policies": {p: policies.count(p) for p in sorted(set(policies))},
                   "activation_checkpointing": plan.activation_checkpointing, "hardware": hw.name}
    model = lora_of(build_model(job["model"], torch.bfloat16 if job["dtype"] == "bf16" else torch.float32),
                    job["lora_r"])
    em = hfe.ElixirModule(model, plan, device=device)
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4))
    step = elixir_step(em, opt)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, losses = [], []
    for i in range(job["warmup"] + job["steps"]):
        ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(i))
        sync()
        t0 = time.perf_counter()
        losses.append(float(step(ids).detach().float().cpu()))
        sync()
        if i >= job["warmup"]:
            times.append(time.perf_counter() - t0)
    report = em.memory_report()
    if device.type == "cuda":
        measured, source = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:
        measured, source = report["peak_total"], "memory_report() peak_total"
    predicted = out["plan"]["predicted_peak_bytes"]
    median = statistics.median(times)
    out.update(status="ok", seq_len=seq, step_times_s=times, median_step_s=median, tokens_per_s=seq / median,
               losses=losses, finite=all(math.isfinite(x) for x in losses), measured_peak_bytes=measured,
               peak_source=source, peak_ratio=measured / predicted if predicted else None,
               step_ratio=median / out["plan"]["predicted_step_s"] if out["plan"]["predicted_step_s"] else None,
               activation_offload=report.get("activation_offload"))
    return out


def main() -> None:
    job, result_path = json.loads(sys.argv[1]), Path(sys.argv[2])
    try:
        runs = {"smoke": run_smoke, "recovery": run_recovery, "disk_tier": run_disk_tier, "trainer": run_trainer,
                "long_context": run_long_context}
        result = runs.get(job["job"], run_train)(job)
    except torch.cuda.OutOfMemoryError as exc:
        result = {"status": "oom", "error": str(exc).split("\n")[0][:400]}
        if torch.cuda.is_available():
            result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    except Exception as exc:
        result = {"status": "error", "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                  "traceback": traceback.format_exc()[-3000:]}
    if os.environ.get("RANK", "0") == "0":
        result_path.write_text(json.dumps(result, indent=1, default=str))
    from hf_elixir.integrations.process_exit import freeze_for_teardown

    freeze_for_teardown()  # the job is done and written


if __name__ == "__main__":
    main()
