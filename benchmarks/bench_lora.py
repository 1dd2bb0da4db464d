"""LoRA fine-tuning: hf_elixir against DDP + LoRA and FSDP2 + LoRA, in one run: step time
and the bytes of frozen base weights each rank holds at peak.

    python benchmarks/bench_lora.py                       # GPT-2 124M and Llama-style 60M
    python benchmarks/bench_lora.py --models llama-60m --steps 3
    python benchmarks/bench_lora.py --plan simple         # a pinned ElixirPlan.simple plan
    python benchmarks/bench_lora.py --quick               # tiny models, a few seconds of steps
    python benchmarks/bench_lora.py --qlora               # QLoRA: the base loaded in 4 bits

Every system fine-tunes the same PEFT model: bench_planner's GPT-2 124M or Llama-style 60M
(same configs, seed 0) with LoRA adapters of rank 16 (alpha 32, no dropout, PEFT's own
initialisation under one seed) on the attention and MLP projections (GPT-2: c_attn, both
c_proj, c_fc; Llama: q/k/v/o_proj, gate/up/down_proj); everything else is frozen. As in
bench_step.py, whose helpers this script uses: CPU ranks over gloo at world size 2, global
batch 4, sequence 128, fp32, torch AdamW (lr 1e-4; the fused kernel for every system),
clipping at 1.0, the same batches for every system.

Systems, in the order they run (one after another in the same ranks, the baselines first):

- ``ddp``            DistributedDataParallel: the frozen base replicated on every rank, the
                     adapters' gradients all-reduced (bench_step's setup).
- ``fsdp2``          ``fully_shard`` on each transformer block and on the root (bench_step's
                     setup); frozen parameters are sharded inside the same units as the
                     adapters beside them, so the base is gathered block by block.
- ``hf_elixir``      the plan ``hfe.plan`` chooses for this PEFT model at its default budget
                     (the machine's memory), as a user gets it; ``--plan simple``: a pinned
                     ``ElixirPlan.simple`` plan instead (bench_step's chunking: chunks up to
                     the largest tensor, packed to 2M elements, an rCache block per chunk).
- ``hf_elixir_min``  ``hfe.plan`` at the smallest memory budget it can meet (the budget its
                     ``PlanError`` names): the plan a device too small for the fast one gets;
                     ``--plan simple``: the simple plan at its fewest rCache blocks.
                     On a CPU device "offloaded" state is host memory all the same: these
                     rows show what the plan costs in time, and what it holds in total.

``--qlora``: QLoRA, every system on the same 4-bit base. The parent saves each seeded base to
a folder once; every process loads it quantised on load by bitsandbytes (nf4, packed codes
stored in bf16 as FSDP needs them, computing in fp32 like the rest of the benchmark), prepares
it with PEFT's ``prepare_model_for_kbit_training`` (no gradient checkpointing: as in the LoRA
runs) and adds the same adapters. DDP replicates the packed base, FSDP2 shards the packed
parameters in its units (FSDP-QLoRA), hf_elixir packs them into frozen chunks. Llama-style
models only (GPT-2's Conv1D projections stay unquantised); results go to ``bench_qlora.json``.

Plans are made once per model in the parent process (``--efficiency``: how ``hfe.plan``
prices compute; ``auto`` times the model here once when this machine has a calibration) and
handed to the ranks as JSON; the plan and its predictions are recorded with the results.

Figures per system (``summary`` in the JSON):

- ``median_step_s``: the median over the timed steps (after ``--warmup`` untimed ones) of
  one optimizer step, barrier to barrier on both ranks; ``tokens_per_s`` = global batch x
  sequence / median; ``ratio_to_ddp`` and ``ratio_to_fsdp2``: this median over theirs.
- ``frozen``: bytes of frozen (base) weights one rank holds, measured in one more untimed
  step after the timed ones (steady state), by inspecting each system's own tensors:

  - ``resident_bytes``: what the rank keeps between steps. DDP: every frozen parameter
    (tied ones once). FSDP2: the storages of the local shards of the frozen DTensors (with
    FSDP2's padding). hf_elixir: the shards of its frozen chunks, wherever the plan places
    them (``on_device_bytes`` is the part on the compute device: the runtime's own
    ``memory_report()["peak"]["frozen_shards"]``; the rest is offloaded to CPU memory,
    which on a CPU machine is the same memory).
  - ``gathered_peak_bytes``: the most bytes of gathered frozen weights held at once during
    that step. hf_elixir: exact; every rCache block a frozen chunk takes or frees goes
    through the chunk's ``take_block``/``free_block``, which the benchmark counts (blocks of
    prefetched chunks and blocks kept from the previous step included). FSDP2: sampled at
    the entry and exit of every leaf module's forward and when its output's gradient is
    computed in backward: the storages of the frozen parameters FSDP2 has swapped to their
    unsharded form then (the root's own parameters, kept unsharded from forward into
    backward, included), plus, for a block FSDP2 has all-gathered but not yet unpacked into
    its parameters (backward's prefetch of the next block), the frozen share of its flat
    all-gather output (read from FSDP2's private ``_all_gather_result``; where a torch
    version lacks it, the figure is a lower bound by up to one block and the JSON says so).
    Between two sampling points FSDP2 runs at most one unit's unshard or reshard, so the
    peak is seen up to the copy buffers of an all-gather in flight. DDP: nothing is
    gathered (0).
  - ``per_rank_peak_bytes`` = resident + gathered peak, and ``share_of_base`` = that over
    the whole frozen base (``base_bytes``): all a rank holds, host and device, which on a
    CPU machine is one memory. ``device_peak_bytes`` leaves out the shards a plan offloads
    to CPU memory: what the same plan would hold on an accelerator (equal to
    ``per_rank_peak_bytes`` for DDP and FSDP2, which offload nothing here).

  Only frozen weights are counted: activations, adapters, gradients and optimizer state are
  not (hf_elixir's whole ledger is under ``memory_report``).
- ``bytes_per_step``: what one rank receives on the wire in one more step, by kind, under
  bench_step's ``WireCounter`` (the same counter and convention for every system).
- ``first_losses``, ``losses_match`` (the first two within 1e-4 relative of the first
  system's: same weights, same batches), ``losses_finite``.

Host memory: every rank starts as ``hf-elixir launch`` starts CPU ranks (glibc's per-thread
cache off), and by default every system runs with freed host memory kept mapped, the
setting hf_elixir makes on a CPU device (``--keep-host-memory all``), so that the allocator
is the same for all. ``--keep-host-memory hf_elixir`` leaves DDP and FSDP2 with glibc's
defaults, as a user gets them (each model then runs in ranks of its own, the baselines
before any ElixirModule exists there to set it).

Results go to benchmarks/results/bench_lora.json and a PNG beside it (``--quick``: a
temporary file unless ``--output`` is given).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import bench_planner
from bench_step import (PACK_SIZE, RESULTS, add_host_memory_option, apply_host_memory_setting, counted_step,
                        elixir_step, pyplot, setup_ddp, setup_fsdp2, timed_steps)

LORA_RANK = 16
LR = 1e-4  # bench_step's
# the attention and MLP projections of each architecture (GPT-2's c_proj is both)
TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
           "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
FULL_MODELS = ("gpt2-124m", "llama-60m")
TINY_MODELS = ("gpt2-tiny", "llama-tiny")  # for --quick and the test: the same code, in seconds
SYSTEMS = ("ddp", "fsdp2", "hf_elixir", "hf_elixir_min")
ELIXIR_SYSTEMS = ("hf_elixir", "hf_elixir_min")
QUICK = {"models": list(TINY_MODELS), "warmup": 1, "steps": 2, "seq_len": 32, "efficiency": "calibrated"}
DEFAULTS = {"models": list(FULL_MODELS), "warmup": 2, "steps": 5, "seq_len": 128, "efficiency": "auto"}

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


# ---------------------------------------------------------------------- models
def tiny_config(name: str):
    """Two-block stand-ins of the benchmarked architectures, for --quick."""
    from transformers import GPT2Config, LlamaConfig

    if name == "gpt2-tiny":
        return GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=512, bos_token_id=0,
                          eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    if name == "llama-tiny":
        return LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
                           bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, use_cache=False)
    raise ValueError(name)


def build_base(name: str) -> nn.Module:
    """The base model, bench_planner's or a tiny one, seeded: the same weights everywhere."""
    from transformers import AutoModelForCausalLM

    if name in TINY_MODELS:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config(name))
    return bench_planner.build(name)


def save_bases(models: list[str], folder: Path) -> dict[str, str]:
    """--qlora: each base saved once, for every process to load quantised on load."""
    out = {}
    for name in models:
        out[name] = str(folder / name)
        build_base(name).save_pretrained(out[name])
    return out


def load_4bit(folder: str) -> nn.Module:
    """A saved base loaded in 4 bits as a QLoRA script loads it (see the module docstring)."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_quant_storage=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=torch.float32)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def build_lora(name: str, base_folder: str | None = None) -> nn.Module:
    """The base model (bench_planner's, or a tiny one; in 4 bits from ``base_folder`` with
    --qlora) with LoRA adapters; the same weights in every process (seeded base, seeded
    adapter initialisation)."""
    from peft import LoraConfig, get_peft_model

    base = build_base(name) if base_folder is None else load_4bit(base_folder)
    kind = base.config.model_type
    torch.manual_seed(1)
    config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=TARGETS[kind],
                        fan_in_fan_out=kind == "gpt2")  # GPT-2's projections are Conv1D
    model = get_peft_model(base, config)
    # from_pretrained returns a model in eval mode; a training loop puts it in train mode.
    # It matters beyond dropout: on a CPU with AVX512 bf16, bitsandbytes re-packs a 4-bit
    # weight in place the first time an eval-mode layer runs on an input without gradients,
    # and under FSDP2 that re-packed copy is lost when the weight is resharded
    return model.train()


def unique_params(tensors) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def frozen_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every frozen parameter a module registers (a tied one under each
    module that registers it)."""
    return [(m, n) for m in model.modules() for n, p in m.named_parameters(recurse=False) if not p.requires_grad]


# ---------------------------------------------------------------------- frozen-byte probes
class ReplicatedProbe:
    """DDP: every rank holds the whole frozen base, all the time."""

    def __init__(self, model: nn.Module) -> None:
        self.resident = sum(nbytes(p) for p in unique_params(p for p in model.parameters() if not p.requires_grad))

    def arm(self, model: nn.Module) -> None:
        pass

    def read(self) -> dict:
        return {"resident_bytes": self.resident, "gathered_peak_bytes": 0, "how": "every frozen parameter"}


class FSDP2Probe:
    """FSDP2: the local shards of the frozen DTensors, and at each sampling point (see the
    module docstring) the frozen parameters in their unsharded form plus the frozen share of
    any all-gather FSDP2 has issued but not yet unpacked (a prefetched block)."""

    def __init__(self, model: nn.Module, slots: list[tuple[nn.Module, str]]) -> None:
        from torch.distributed.tensor import DTensor

        self.slots, self.dtensor = slots, DTensor
        storages = {}
        for module, name in slots:  # after fully_shard, before any step: all sharded
            p = getattr(module, name)
            assert isinstance(p, DTensor), f"{name} is not sharded"
            local = p.to_local().untyped_storage()
            storages[local.data_ptr()] = local.nbytes()
        self.resident = sum(storages.values())
        self.groups = self._groups(model)
        self.handles: list = []
        self.peak = 0
        self.samples = 0

    @staticmethod
    def _groups(model: nn.Module) -> list | None:
        """(parameter group, frozen share of its elements) of every FSDP2 unit, read from
        FSDP2's private state; None where this torch's FSDP2 does not have it."""
        from torch.distributed.fsdp import FSDPModule

        try:
            groups = []
            for m in model.modules():
                group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
                if group is None:
                    continue
                sizes = [(fp.sharded_param.requires_grad, fp._orig_size.numel()) for fp in group.fsdp_params]
                frozen = sum(n for trainable, n in sizes if not trainable)
                groups.append((group, frozen / max(1, sum(n for _, n in sizes))))
                group._all_gather_result  # noqa: B018 (present in this version?)
            return groups
        except AttributeError:
            return None

    def gathered_bytes(self) -> int:
        storages = {}
        for module, name in self.slots:
            p = getattr(module, name)
            if not isinstance(p, self.dtensor):
                s = p.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()  # 0 once FSDP2 frees it
        pending = 0
        for group, share in self.groups or ():
            result = group._all_gather_result
            if result is not None:
                pending += share * result.all_gather_output.untyped_storage().nbytes()
        return sum(storages.values()) + int(pending)

    def sample(self, *_) -> None:
        self.samples += 1
        self.peak = max(self.peak, self.gathered_bytes())

    def _after_forward(self, module, args, output) -> None:
        self.sample()
        outs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self.sample)

    def arm(self, model: nn.Module) -> None:
        self.peak, self.samples = self.gathered_bytes(), 0
        for m in model.modules():
            if next(m.children(), None) is None:  # a leaf
                self.handles.append(m.register_forward_pre_hook(self.sample))
                self.handles.append(m.register_forward_hook(self._after_forward))

    def read(self) -> dict:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        how = "local shards of frozen DTensors + unsharded frozen parameters sampled at leaf modules"
        how += (" + the frozen share of pending all-gathers" if self.groups is not None
                else " (pending all-gathers not visible in this torch: a lower bound by up to one block)")
        return {"resident_bytes": self.resident, "gathered_peak_bytes": self.peak, "samples": self.samples,
                "pending_all_gathers_seen": self.groups is not None, "how": how}


class ElixirProbe:
    """hf_elixir: the shards of the frozen chunks, and every rCache block a frozen chunk takes
    or frees, counted as it happens (the chunk's own take_block/free_block)."""

    def __init__(self, em) -> None:
        self.em = em
        self.frozen = [c for c in em.chunks if c.frozen]
        self.resident = sum(nbytes(c.shard) for c in self.frozen)
        self.current = sum(c.full_bytes for c in self.frozen if c.has_block and not c.in_place)
        self.peak = self.current
        for chunk in self.frozen:
            chunk.take_block = self._counting(chunk, chunk.take_block, +1)
            chunk.free_block = self._counting(chunk, chunk.free_block, -1)

    def _counting(self, chunk, method, sign: int):
        def counted():
            method()
            self.current += sign * chunk.full_bytes
            self.peak = max(self.peak, self.current)

        return counted

    def arm(self, model: nn.Module) -> None:
        self.peak = self.current  # what is held when the step starts counts

    def read(self) -> dict:
        rep = self.em.memory_report()
        return {"resident_bytes": self.resident, "gathered_peak_bytes": self.peak,
                "on_device_bytes": rep["peak"]["frozen_shards"],
                "offloaded_bytes": self.resident - rep["current"]["frozen_shards"],
                "how": "shards of frozen chunks + frozen chunks' rCache blocks, counted at take/free"}


# ---------------------------------------------------------------------- systems
def setup_replicated(model: nn.Module, plan_json: str | None):
    probe = ReplicatedProbe(model)
    step, _ = setup_ddp(model)
    return step, probe, {}


def setup_sharded(model: nn.Module, plan_json: str | None):
    slots = frozen_slots(model)  # before fully_shard swaps the parameters for DTensors
    step, root_share = setup_fsdp2(model)
    return step, FSDP2Probe(model, slots), {"extra": root_share}


def setup_hf_elixir(model: nn.Module, plan_json: str):
    import hf_elixir as hfe

    plan = hfe.ElixirPlan.from_json(plan_json)
    em = hfe.ElixirModule(model, plan)
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=LR))
    probe = ElixirProbe(em)

    def extra() -> dict:
        rep = em.memory_report()
        return {"memory_report_peak": rep["peak"], "peak_device_bytes": rep["peak_total"],
                "cache_stats": rep["cache_stats"]}

    return elixir_step(em, opt), probe, {"extra": extra}


SETUPS = {"ddp": setup_replicated, "fsdp2": setup_sharded, "hf_elixir": setup_hf_elixir,
          "hf_elixir_min": setup_hf_elixir}


# ---------------------------------------------------------------------- planning (parent)
def describe(plan) -> dict:
    """What a plan decided, and what the planner predicted for it."""
    frozen = [c for c in plan.chunks if c.frozen]
    trainable = [c for c in plan.chunks if not c.frozen]
    pred = plan.predictions or {}
    return {"n_chunks": plan.n_chunks, "frozen_chunks": len(frozen), "chunk_size": plan.chunk_size,
            "rcache_blocks": plan.rcache_blocks, "min_rcache_blocks": plan.min_rcache_blocks,
            "activation_checkpointing": plan.activation_checkpointing, "prefetch_depth": plan.prefetch_depth,
            "frozen_offloaded_chunks": sum(c.param_placement == "cpu" for c in frozen),
            "optim_offloaded_chunks": sum(c.optim_placement == "cpu" for c in trainable),
            "predicted_peak_bytes": pred.get("peak_bytes"), "predicted_step_s": pred.get("step_time_s"),
            "budget_bytes": pred.get("budget_bytes"), "compute_efficiency": pred.get("compute_efficiency")}


def make_plans(model_name: str, args) -> dict[str, dict]:
    """The plans of the hf_elixir systems for one model: {system: {"json", "describe", ...}}."""
    import hf_elixir as hfe
    from hf_elixir.profile import profile_model

    wanted = [s for s in args.systems if s in ELIXIR_SYSTEMS]
    if not wanted:
        return {}
    model = build_lora(model_name, args.base_folders.get(model_name))
    W = args.world_size
    plans = {}
    if args.plan == "simple":
        largest = max(p.numel() for p in model.parameters())
        roomy = hfe.ElixirPlan.simple(model, W, chunk_size=largest, rcache_blocks=None, pack_size=PACK_SIZE)
        plans["hf_elixir"] = (roomy, {"how": "ElixirPlan.simple, an rCache block per chunk"})
        lean = hfe.ElixirPlan.simple(model, W, chunk_size=largest, rcache_blocks=roomy.min_rcache_blocks,
                                     pack_size=PACK_SIZE)
        plans["hf_elixir_min"] = (lean, {"how": "ElixirPlan.simple at its fewest rCache blocks"})
    else:
        batch = (args.global_batch // W, args.seq_len)
        kw = dict(world_size=W, dtype="fp32", optimizer="adamw")
        t0 = time.perf_counter()
        # profiled once (on the meta device), as hfe.plan would; every plan below reuses it
        kw["profile"] = profile_model(model, batch, dtype="float32",
                                      attention_target=hfe.HardwareProfile.detect().device_type)
        chosen = hfe.plan(model, batch, efficiency=args.efficiency, **kw)
        priced = (chosen.predictions.get("compute_efficiency") or {}).get("value")
        kw["efficiency"] = priced if priced else "calibrated"  # measured once, reused
        plans["hf_elixir"] = (chosen, {"how": "hfe.plan at its default budget",
                                       "planning_s": time.perf_counter() - t0})
        if "hf_elixir_min" in wanted:
            try:
                hfe.plan(model, batch, memory_budget=1, **kw)
                raise AssertionError("a 1-byte budget was accepted")
            except hfe.PlanError as err:
                floor = getattr(err, "min_memory", None)
                if floor is None:
                    raise
            lean = hfe.plan(model, batch, memory_budget=floor, **kw)
            plans["hf_elixir_min"] = (lean, {"how": "hfe.plan at the smallest budget it can meet",
                                             "budget_bytes": floor})
    out = {}
    for system in wanted:
        plan, info = plans[system]
        out[system] = {"json": plan.to_json(), "plan": {**describe(plan), **info}}
        if args.show_plans:
            print(f"{model_name} {system}:\n{plan.summary()}\n", flush=True)
    return out


# ---------------------------------------------------------------------- ranks
def run_system(system: str, model_name: str, args, plan_json: str | None) -> dict:
    """Build, set up and train one system; time its steps; then one more step counted on the
    wire and probed for frozen bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    model = build_lora(model_name, args.base_folders.get(model_name))
    vocab = model.config.vocab_size
    trainable = sum(p.numel() for p in unique_params(p for p in model.parameters() if p.requires_grad))
    base = sum(nbytes(p) for p in unique_params(p for p in model.parameters() if not p.requires_grad))
    step, probe, hooks = SETUPS[system](model, plan_json)
    setup_s = time.perf_counter() - t0
    times, losses = timed_steps(step, rank, world, args, vocab)
    probe.arm(model)
    wire = counted_step(step, None, rank, world, args.warmup + args.steps, args, vocab)
    frozen = probe.read()
    # the figures of the rank holding the most (ranks may differ by a shard's padding)
    figures = torch.tensor([frozen["resident_bytes"], frozen["gathered_peak_bytes"]], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    frozen.update(resident_bytes=int(figures[0]), gathered_peak_bytes=int(figures[1]), base_bytes=base)
    frozen["per_rank_peak_bytes"] = frozen["resident_bytes"] + frozen["gathered_peak_bytes"]
    frozen["share_of_base"] = frozen["per_rank_peak_bytes"] / base
    # what the same plan would keep on an accelerator: offloaded shards stay in host memory
    frozen["device_peak_bytes"] = frozen["per_rank_peak_bytes"] - frozen.get("offloaded_bytes", 0)
    out = {"median_step_s": statistics.median(times), "step_times_s": times, "losses": losses,
           "bytes_per_step": wire, "frozen": frozen, "trainable_params": trainable, "setup_s": setup_s}
    if "extra" in hooks:
        out.update(hooks["extra"]())
    del model, step, probe, hooks
    return out


def rank_main(rank: int, args, models: list[str], plans: dict, rendezvous: str, out: str) -> None:
    torch.set_num_threads(max(1, args.threads))
    apply_host_memory_setting(args)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=args.world_size)
    results: dict = {}
    for model_name in models:
        for system in args.systems:
            plan = plans[model_name].get(system)
            res = run_system(system, model_name, args, None if plan is None else plan["json"])
            results.setdefault(model_name, {})[system] = res
            if rank == 0:
                print(f"{model_name:10s} {system:14s} median step {res['median_step_s']:.3f} s "
                      f"(built and set up in {res['setup_s']:.1f} s)", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(models: list[str], args, plans: dict) -> dict:
    """Train every system on ``models`` in one set of fresh ranks (spawned, started as
    hf-elixir launch starts CPU ranks); a rank's failure ends the benchmark with its
    traceback. Returns {model: {system: figures}}."""
    import torch.multiprocessing as mp

    from hf_elixir.runtime.host_memory import spawning_cpu_ranks

    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        out = Path(tmp) / "results.json"
        with spawning_cpu_ranks():
            mp.start_processes(rank_main, args=(args, models, plans, str(Path(tmp) / "rendezvous"), str(out)),
                               nprocs=args.world_size, join=True, start_method="spawn")
        return json.loads(out.read_text())


# ---------------------------------------------------------------------- results
def summarise(results: dict, plans: dict, args) -> dict:
    tokens = args.global_batch * args.seq_len
    summary = {}
    for model_name, by_system in results.items():
        med = {s: r["median_step_s"] for s, r in by_system.items()}
        ref = by_system[args.systems[0]]["losses"][:2]
        rows = {}
        for system, res in by_system.items():
            rows[system] = {
                "median_step_s": med[system],
                "tokens_per_s": tokens / med[system],
                "ratio_to_ddp": med[system] / med["ddp"] if "ddp" in med else None,
                "ratio_to_fsdp2": med[system] / med["fsdp2"] if "fsdp2" in med else None,
                "frozen": res["frozen"],
                "bytes_per_step": res["bytes_per_step"],
                "trainable_params": res["trainable_params"],
                "first_losses": res["losses"][:2],
                "losses_match": all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(ref, res["losses"][:2])),
                "losses_finite": all(math.isfinite(x) for x in res["losses"]),
            }
            for key in ("memory_report_peak", "peak_device_bytes", "cache_stats", "root_param_share"):
                if key in res:
                    rows[system][key] = res[key]
            if system in plans.get(model_name, {}):
                rows[system]["plan"] = plans[model_name][system]["plan"]
        summary[model_name] = rows
    return summary


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    n = len(summary)
    fig, axes = plt.subplots(2, n, figsize=(5.5 * n, 8), squeeze=False)
    colors = {"ddp": "#888", "fsdp2": "#c66", "hf_elixir": "#4a7", "hf_elixir_min": "#7a4"}
    for col, (model_name, rows) in enumerate(summary.items()):
        names = list(rows)
        x = range(len(names))
        ax = axes[0][col]
        ax.bar(x, [rows[s]["median_step_s"] for s in names], color=[colors.get(s, "#68c") for s in names])
        ax.set_xticks(x, names, fontsize=8)
        ax.set_title(f"{model_name} + LoRA r{LORA_RANK}: median step (s)", fontsize=10)
        ax.set_ylim(top=1.15 * max(rows[s]["median_step_s"] for s in names))  # room for the ratios
        for i, s in enumerate(names):
            parts = [f"{rows[s][key]:.2f}x {base}"
                     for key, base in (("ratio_to_ddp", "ddp"), ("ratio_to_fsdp2", "fsdp2"))
                     if rows[s][key] is not None and s != base]
            ax.text(i, rows[s]["median_step_s"], "\n".join(parts), ha="center", va="bottom", fontsize=7)
        ax = axes[1][col]
        mib = 2**20
        resident = [rows[s]["frozen"]["resident_bytes"] / mib for s in names]
        gathered = [rows[s]["frozen"]["gathered_peak_bytes"] / mib for s in names]
        ax.bar(x, resident, color=[colors.get(s, "#68c") for s in names], label="shards (DDP: replica)")
        ax.bar(x, gathered, bottom=resident, color="#ddd", edgecolor="#999", hatch="//", label="gathered (peak)")
        base = next(iter(rows.values()))["frozen"]["base_bytes"] / mib
        ax.axhline(base, color="k", ls="--", lw=0.8, label="whole frozen base")
        lower = [(i, rows[s]["frozen"]["device_peak_bytes"] / mib) for i, s in enumerate(names)
                 if rows[s]["frozen"]["device_peak_bytes"] != rows[s]["frozen"]["per_rank_peak_bytes"]]
        if lower:
            ax.scatter([i for i, _ in lower], [v for _, v in lower], marker="_", s=900, color="k", zorder=3,
                       label="on an accelerator (offloaded shards left out)")
        ax.set_xticks(x, names, fontsize=8)
        ax.set_title(f"{model_name}: frozen weights per rank at peak (MiB)", fontsize=10)
        ax.set_ylim(top=1.45 * max(max(a + b for a, b in zip(resident, gathered)), base))  # room for the legend
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_table(summary: dict) -> None:
    mib = 2**20
    print(f"\n{'model':10s} {'system':14s} {'step s':>7s} {'tok/s':>6s} {'xDDP':>5s} {'xFSDP2':>6s} "
          f"{'frozen MiB/rank: held':>21s} {'+gathered':>9s} {'=peak':>7s} {'of base':>7s} {'on dev':>7s}  losses")
    for model_name, rows in summary.items():
        for system, row in rows.items():
            f = row["frozen"]
            ratios = " ".join("" if row[k] is None else f"{row[k]:{w}.2f}" for k, w in (("ratio_to_ddp", 5),
                                                                                     ("ratio_to_fsdp2", 6)))
            print(f"{model_name:10s} {system:14s} {row['median_step_s']:7.3f} {row['tokens_per_s']:6.0f} {ratios} "
                  f"{f['resident_bytes'] / mib:21.1f} {f['gathered_peak_bytes'] / mib:9.1f} "
                  f"{f['per_rank_peak_bytes'] / mib:7.1f} {f['share_of_base']:7.2f} "
                  f"{f['device_peak_bytes'] / mib:7.1f}  "
                  f"{'equal' if row['losses_match'] else 'DIFFER'}{'' if row['losses_finite'] else ' NOT FINITE'}")
        for system, row in rows.items():
            if "plan" in row:
                p = row["plan"]
                print(f"  {system}: {p['how']}: {p['n_chunks']} chunks ({p['frozen_chunks']} frozen), rCache "
                      f"{p['rcache_blocks']}, checkpointing {'on' if p['activation_checkpointing'] else 'off'}, "
                      f"frozen offloaded {p['frozen_offloaded_chunks']}/{p['frozen_chunks']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"tiny models and few steps unless given otherwise: {QUICK}")
    p.add_argument("--models", nargs="+", choices=bench_planner.MODELS + TINY_MODELS,
                   help=f"default {DEFAULTS['models']}")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--plan", choices=("planner", "simple"), default="planner",
                   help="hf_elixir's plans: hfe.plan's choice (default) or a pinned ElixirPlan.simple")
    p.add_argument("--efficiency", help="how hfe.plan prices compute (auto, calibrated, measure or a number); "
                                        f"default {DEFAULTS['efficiency']}")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, help=f"default {DEFAULTS['seq_len']}")
    p.add_argument("--warmup", type=int, help=f"default {DEFAULTS['warmup']}")
    p.add_argument("--steps", type=int, help=f"default {DEFAULTS['steps']}")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    add_host_memory_option(p)
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA: every system on the base loaded in 4 bits (nf4; needs bitsandbytes)")
    p.add_argument("--show-plans", action="store_true", help="print each hf_elixir plan's summary")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, [m for m in value if "llama" in m] if key == "models" and args.qlora else value)
    if args.qlora and any("llama" not in m for m in args.models):
        p.error("--qlora benchmarks Llama-style models (GPT-2's Conv1D projections stay unquantised)")
    args.base_folders = {}
    try:
        args.efficiency = float(args.efficiency)
    except ValueError:
        pass
    if args.output is None:
        name = "bench_qlora" if args.qlora else "bench_lora"
        args.output = Path(tempfile.gettempdir()) / f"{name}_quick.json" if args.quick else RESULTS / f"{name}.json"
    if args.global_batch % args.world_size:
        p.error("--global-batch must be divisible by --world-size")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    args.systems = [s for s in SYSTEMS if s in args.systems]  # baselines first
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_qlora_bases_") as bases:
        if args.qlora:
            args.base_folders = save_bases(args.models, Path(bases))
        run(args)


def run(args) -> None:
    plans = {model_name: make_plans(model_name, args) for model_name in args.models}
    # one set of ranks for every model; with glibc's defaults for the baselines, one set per
    # model, so that no baseline runs after hf_elixir has changed the allocator's setting
    groups = [args.models] if args.keep_host_memory == "all" else [[m] for m in args.models]
    results = {}
    for models in groups:
        results.update(run_ranks(models, args, plans))
    summary = summarise(results, plans, args)
    record = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "lora": {"r": LORA_RANK, "alpha": 2 * LORA_RANK, "dropout": 0.0, "targets": TARGETS},
        "qlora": {"quant_type": "nf4", "quant_storage": "bfloat16", "compute_dtype": "float32"} if args.qlora else None,
        "torch": torch.__version__,
        "versions": {name: _version(name) for name in ("transformers", "peft", "bitsandbytes")},
        "summary": summary,
        "plans": {m: {s: json.loads(v["json"]) for s, v in by.items()} for m, by in plans.items()},
        "raw": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1))
    plot(summary, args.output.with_suffix(".png"))
    print_table(summary)
    print(f"wrote {args.output}")


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


if __name__ == "__main__":
    main()
