"""``hf-elixir``: the command line.

Each subcommand is a ``register_<name>(subparsers)`` function that adds its parser and sets
``func``; ``COMMANDS`` lists them, so a new subcommand (export, config, launch, demo) is one
function appended to the list. Exit status: 0 success, 1 when no plan fits, 2 for bad
arguments (unknown preset, unreadable memory size or model).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

from hf_elixir.checkpoint import CheckpointError, export
from hf_elixir.cli.common import EXIT_INFEASIBLE, EXIT_OK, EXIT_USAGE, CLIError
from hf_elixir.cli.demo import register_demo
from hf_elixir.cli.launch import launch_main, register_config, register_launch
from hf_elixir.hardware import HardwareError, HardwareProfile, cache_path, parse_memory
from hf_elixir.measure import calibrate_machine, with_disk
from hf_elixir.planner.efficiency import compiled_efficiency
from hf_elixir.planner.longest import GRANULE, LIMIT, longest_sequence, probe_with
from hf_elixir.planner.record import PlanError
from hf_elixir.planner.search import plan as make_plan
from hf_elixir.planner.summary import _MEM_ORDER, chosen_as_dict, summary
from hf_elixir.profile import profile_model
from hf_elixir.profile.configs import known_config
from hf_elixir.profile.forked import available_workers
from hf_elixir.profile.lora import meta_lora_model
from hf_elixir.profile.quant import meta_4bit
from hf_elixir.profile.trace import build_meta_model
from hf_elixir.optimizers import DEFAULT as DEFAULT_OPTIMIZER, OPTIMIZERS
from hf_elixir.vocab import BARE_MINIMUM


# ---------------------------------------------------------------------- model loading
def load_config(model: str):
    """A transformers config from a config JSON, a model folder, a known name or a hub id.

    Only the config is read, never weights.
    """
    from transformers import AutoConfig

    path = Path(model)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CLIError(f"cannot read config JSON {model}: {e}") from e
        if "model_type" not in data:
            raise CLIError(f"{model} has no 'model_type'; is it a transformers config.json?")
        model_type = data.pop("model_type")
        try:
            cfg = AutoConfig.for_model(model_type, **data)
        except ValueError as e:
            raise CLIError(f"{model}: {e}") from e
        cfg._name_or_path = path.stem if path.name != "config.json" else path.parent.name
        return cfg
    if path.is_dir():
        if not (path / "config.json").exists():
            raise CLIError(f"{model} is a folder without config.json")
        return load_config(str(path / "config.json"))
    cfg = known_config(model)
    if cfg is not None:
        return cfg
    try:
        return AutoConfig.from_pretrained(model)
    except Exception as e:  # offline, unknown id, gated repo...
        raise CLIError(
            f"cannot load a config for {model!r} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "pass a config JSON or a local model folder"
        ) from e


# ---------------------------------------------------------------------- plan
def register_plan(sub) -> None:
    p = sub.add_parser("plan", help="profile a model on the meta device and print the plan the search picks",
                       description="Profile MODEL (config only, never weights) and print the fastest plan that fits.")
    p.add_argument("model", help="hub id, local model folder, config JSON, or a known name (gpt2-xl, llama-2-7b, ...)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: the hardware's)")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default 1)")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 24GiB, '24 GB', 24000MB")
    p.add_argument("--hardware", default=None,
                   help=f"hardware preset ({', '.join(HardwareProfile.presets())}); default: this machine")
    p.add_argument("--batch-size", type=int, default=1, help="micro-batch size per GPU")
    p.add_argument("--seq-len", type=_seq_len, default=1024, metavar="N|max",
                   help="tokens per sequence (default 1024); 'max': the longest that fits at the batch size, "
                        "found by planning at a few lengths (multiples of 1024)")
    p.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32")
    p.add_argument("--optimizer", default=DEFAULT_OPTIMIZER, choices=OPTIMIZERS,
                   help="the update the run will use (a name of the optimizer table)")
    p.add_argument("--efficiency", default="auto",
                   help="how compute is priced: auto (time the model here when planning for this calibrated "
                        "machine), measure, calibrated (the calibration's figure for the model's width), or a number")
    p.add_argument("--compile", action="store_true",
                   help="price a run whose decoder blocks are compiled (torch_compile / compile: true): the eager "
                        "efficiency (calibrated, or --efficiency N) times an assumed factor, reported as an "
                        "estimate until calibration times a compiled block")
    p.add_argument("--lora-r", type=int, default=None, metavar="N",
                   help="plan a LoRA fine-tune of rank N (needs peft): the base frozen and sharded, "
                        "adapters trained")
    p.add_argument("--lora-targets", default=None, metavar="NAMES",
                   help="comma-separated modules LoRA adapts, e.g. q_proj,v_proj (default: every "
                        "projection in the decoder blocks: attention and MLP)")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="plan QLoRA: the base loaded in 4 bits by bitsandbytes (nf4, every linear layer but "
                        "the head, as BitsAndBytesConfig(load_in_4bit=True) does), with --lora-r adapters; "
                        "needs bitsandbytes")
    p.add_argument("--double-quant", action="store_true",
                   help="with --load-in-4bit: bnb_4bit_use_double_quant (block scales in 8 bits)")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="host memory per machine the plan may use, e.g. 64GiB (default: the preset's, or what "
                        "this machine has available)")
    p.add_argument("--nvme", nargs="?", const="", default=None, metavar="PATH",
                   help="plan with a disk tier for optimizer state that device and host memory cannot hold; "
                        "PATH (a directory) is checked for free space and its bandwidth measured (cached), "
                        "without PATH the preset's NVMe estimate is used")
    p.add_argument("--nvme-size", default=None, metavar="SIZE",
                   help="free disk space per machine the disk tier may use, e.g. 500GB (default: PATH's free "
                        "space; without PATH, unchecked)")
    p.add_argument("--json", dest="json_path", default=None, help="write the plan as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of memory and step-time breakdowns here")
    p.set_defaults(func=cmd_plan)


def _hardware_from_args(args):
    try:
        hw = HardwareProfile.preset(args.hardware) if args.hardware else HardwareProfile.detect()
        memory = parse_memory(args.gpu_memory, BARE_MINIMUM) if args.gpu_memory is not None else None
        if getattr(args, "host_memory", None) is not None:  # checked here, applied by the search
            parse_memory(args.host_memory, BARE_MINIMUM)
    except HardwareError as e:
        raise CLIError(str(e)) from e
    if args.gpus is not None and args.gpus < 1:
        raise CLIError(f"--gpus must be >= 1, got {args.gpus}")
    if args.nodes is not None and args.nodes < 1:
        raise CLIError(f"--nodes must be >= 1, got {args.nodes}")
    if not args.hardware and hw.device_type != "cuda" and (args.gpus or args.gpu_memory):
        print(f"hf-elixir {args.command}: note: no --hardware given and this machine has no GPU, so the plan "
              f"is for its CPU ({hw.name}); pass --hardware (e.g. a100-80g, rtx4090) to plan for GPUs",
              file=sys.stderr)
    return _with_disk(hw.with_cluster(gpus_per_node=args.gpus, nodes=args.nodes, device_memory=memory), args)


def _with_disk(hw: HardwareProfile, args) -> HardwareProfile:
    """``hw`` with the disk tier's figures from ``--nvme PATH`` (its measured bandwidth,
    cached per machine and path, and its free space) and ``--nvme-size``."""
    if getattr(args, "nvme", None) is None:
        if getattr(args, "nvme_size", None) is not None:
            raise CLIError("--nvme-size sizes the disk tier; add --nvme to plan with one")
        return hw
    if args.nvme:
        root = Path(args.nvme).expanduser()
        if not root.is_dir():
            raise CLIError(f"--nvme {args.nvme}: not a directory; name an existing directory on a fast local disk")
        hw = with_disk(hw, root)
    if args.nvme_size is not None:
        try:
            hw.disk_free = parse_memory(args.nvme_size, BARE_MINIMUM)
        except HardwareError as e:
            raise CLIError(f"--nvme-size: {e}") from e
    return hw


def _lora_builder(args) -> Callable | None:
    """With ``--lora-r``: what builds the LoRA fine-tune of a config on the meta device
    (``hf_elixir.profile.lora``; its base in 4 bits with ``--load-in-4bit``), called by the
    profiler on the config, or on shortened copies of it when it profiles a few layers and
    unfolds them (``profile.fold``). None without ``--lora-r``: the config's model is planned."""
    if args.lora_r is None:
        if args.lora_targets:
            raise CLIError("--lora-targets needs --lora-r (the adapters' rank)")
        if args.load_in_4bit:
            raise CLIError("--load-in-4bit plans QLoRA, whose 4-bit base cannot train: add --lora-r N "
                           "(the adapters' rank, e.g. --lora-r 16)")
        return None
    if args.double_quant and not args.load_in_4bit:
        raise CLIError("--double-quant is a setting of the 4-bit base: add --load-in-4bit")
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()] if args.lora_targets else None

    def build(cfg):
        try:
            base = cfg
            if args.load_in_4bit:
                base = meta_4bit(build_meta_model(cfg, args.dtype), compute_dtype=args.dtype,
                                 double_quant=args.double_quant)
            return meta_lora_model(base, args.lora_r, targets, dtype=args.dtype)
        except (ImportError, ValueError) as e:
            raise CLIError(str(e)) from e

    return build


def _seq_len(text: str) -> int | str:
    """``--seq-len``: a positive number of tokens, or ``max``."""
    if text.strip().lower() == "max":
        return "max"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'max', got {text!r}") from None


def _efficiency(text: str) -> float | str:
    """``--efficiency`` as the planner takes it, checked before anything runs: a word, or a
    finite, positive number (``nan`` and ``inf`` read as floats and would price nothing)."""
    words = ("auto", "measure", "calibrated")
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is None and text in words:
        return text
    if number is None or not math.isfinite(number) or number <= 0:
        raise CLIError(f"--efficiency {text}: use {', '.join(words)} or a finite, positive number")
    return number


def cmd_plan(args) -> int:
    if args.batch_size < 1 or (args.seq_len != "max" and args.seq_len < 1):
        raise CLIError("--batch-size and --seq-len must be positive")
    efficiency = _efficiency(args.efficiency)
    if args.compile and efficiency == "measure":
        raise CLIError("--compile with --efficiency measure: the measurement times the eager model and "
                       "calibration does not time a compiled block yet; use --efficiency calibrated or a number")
    hw = _hardware_from_args(args)
    cfg = load_config(args.model)
    build = _lora_builder(args)
    if build is not None:
        # the fine-tune exists only on the meta device: there is nothing to time
        if efficiency == "measure":
            raise CLIError("--efficiency measure times the model, but a LoRA plan builds it on the meta "
                           "device (no values to run): use --efficiency calibrated or a number")
        if efficiency == "auto":
            efficiency = "calibrated"
    compiled = None
    if args.compile:  # the eager efficiency (timing the eager model would price the wrong run) times the factor
        compiled = compiled_efficiency("calibrated" if efficiency == "auto" else efficiency,
                                       getattr(cfg, "hidden_size", None), hw, hw.world_size)
        efficiency = compiled["value"]
    workers = available_workers()  # this process has no threads of its own: planning may fork

    def plan_at(seq_len: int):
        profile = None
        if build is not None:
            built: list = []

            def build_and_keep(config):
                built.append(build(config))
                return built[-1]

            profile = profile_model(cfg, (args.batch_size, seq_len), dtype=args.dtype,
                                    attention_target=hw.device_type, build=build_and_keep, workers=workers)
            targets = ",".join(sorted(built[-1].peft_config["default"].target_modules))
            # name the fine-tune in the summary
            profile.model_name = (f"{args.model}{' in 4 bits (nf4)' if args.load_in_4bit else ''}"
                                  f" + LoRA r{args.lora_r} ({targets})")
        return make_plan(cfg, (args.batch_size, seq_len), hardware=hw, world_size=hw.world_size,
                         dtype=args.dtype, optimizer=args.optimizer, efficiency=efficiency,
                         profile=profile, host_memory=args.host_memory, nvme=args.nvme is not None,
                         workers=workers)

    if args.seq_len == "max":
        started = time.perf_counter()
        found = longest_sequence(probe_with(plan_at), hw.device_memory)
        if found.best is None:
            beyond = found.beyond
            print(f"hf-elixir plan: no sequence length fits at batch size {args.batch_size}: "
                  f"{beyond.error if beyond is not None else 'nothing was planned'}", file=sys.stderr)
            return EXIT_INFEASIBLE
        result = found.best.plan
        print(summary(result))
        _report_compiled(result, compiled)
        tried = ", ".join(f"{q.seq_len} {'fits' if q.fits else 'no'}" for q in found.probes)
        limit = (f"{found.beyond.seq_len} does not fit" if found.beyond is not None
                 else f"the search stops at {LIMIT} tokens")
        print(f"\nlongest sequence that fits at batch size {args.batch_size}: {found.best.seq_len} tokens "
              f"(in steps of {GRANULE}; {limit}); {len(found.probes)} plans in "
              f"{time.perf_counter() - started:.1f} s: {tried}")
    else:
        try:
            result = plan_at(args.seq_len)
        except PlanError as e:
            print(f"hf-elixir plan: {e}", file=sys.stderr)
            return EXIT_INFEASIBLE
        print(summary(result))
        _report_compiled(result, compiled)
    if args.json_path:
        result.to_json(args.json_path)
        print(f"\nplan written to {args.json_path}")
    if args.plot:
        plot_plan(result, args.plot)
        print(f"plot written to {args.plot}")
    return EXIT_OK


def _report_compiled(plan, compiled: dict | None) -> None:
    """With ``--compile``: the estimate in the plan (``predictions["compile"]``, written with
    ``--json``) and a line under its summary saying what was assumed."""
    if compiled is None:
        return
    plan.predictions["compile"] = compiled
    print(f"  compiled (--compile): compute priced at {compiled['factor']:.2f}x the eager run's "
          f"({compiled['eager']:.2f} -> {compiled['value']:.2f}x the per-operator figures): an estimate, "
          "assumed (planner/efficiency.py COMPILED_COMPUTE_FACTOR) until calibration times a compiled block")


def plot_plan(plan, path: str) -> None:
    """PNG: memory by category against the budget (chosen plan and alternatives) and the
    predicted step-time breakdown."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is in the `plot` extra
        raise CLIError("--plot needs matplotlib: pip install 'hf_elixir[plot]'") from e

    entries = [("chosen", chosen_as_dict(plan))] + [(f"alt {i + 1}", a) for i, a in enumerate(plan.alternatives)]
    gib = 2**30
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    labels = [name for name, _ in entries]
    bottom = [0.0] * len(entries)
    for cat in _MEM_ORDER:
        vals = [d.get("memory", {}).get(cat, 0) / gib for _, d in entries]
        ax1.bar(labels, vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    budget = plan.predictions.get("budget_bytes")
    if budget:
        ax1.axhline(budget / gib, color="black", linestyle="--", label="budget")
    ax1.set_ylabel("GiB per device")
    ax1.set_title("predicted peak memory")
    ax1.legend(fontsize=7)
    parts = ("compute", "exposed_communication", "device_optimizer", "exposed_cpu")
    bottom = [0.0] * len(entries)
    for part in parts:
        vals = [d.get("time", {}).get(part, 0) * 1e3 for _, d in entries]
        ax2.bar(labels, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_ylabel("ms per step")
    ax2.set_title("predicted step time")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


# ---------------------------------------------------------------------- calibrate
def register_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and cache the hardware profile as JSON")
    p.add_argument("--output", default=None, help="where to write the JSON (default: the user cache)")
    p.add_argument("--quick", action="store_true", help="smaller measurements (seconds, less accurate)")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    prof = calibrate_machine(output=args.output, quick=args.quick)
    print(prof.describe())
    print(f"\nsaved to {args.output or cache_path()}")
    return EXIT_OK


# ---------------------------------------------------------------------- export
def register_export(sub) -> None:
    p = sub.add_parser("export", help="consolidate a sharded checkpoint into a from_pretrained() folder",
                       description="Write OUT/model.safetensors (or shards with model.safetensors.index.json), "
                                   "config.json, generation_config.json and tokenizer files from the hf_elixir "
                                   "checkpoint CKPT. Runs in one process; no GPU, no process group.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory written by hf_elixir.checkpoint.save")
    p.add_argument("output", metavar="OUT", help="new (or empty) output directory")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: the model's own dtypes)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB, 500MB, 2GiB")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    try:
        info = export(args.checkpoint, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size,
                      verify=not args.no_verify)
    except CheckpointError as e:
        raise CLIError(str(e)) from e
    print(f"wrote {info['output']}: {info['tensors']} tensors, {info['total_bytes'] / 2**20:.1f} MiB in "
          f"{', '.join(info['files'])}" + ("" if info["has_config"] else " (no config.json in the checkpoint)"))
    return EXIT_OK


# ---------------------------------------------------------------------- entry point
def _integration_commands() -> list[Callable]:
    return [register_config, register_launch, register_demo]


COMMANDS: list[Callable] = [register_plan, register_calibrate, register_export, *_integration_commands()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-elixir", description="Automatic memory planning and a "
                                     "chunk-based sharded runtime for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for register in COMMANDS:
        register(sub)
    return parser


def run() -> None:
    """The ``hf-elixir`` command: ``main`` with the process's arguments, then exit. Python's
    last cycle collection at exit walks every object the command made (a 70B plan's search
    leaves millions), about 1.5 s of a 10 s ``plan``; the process is ending, so they are
    frozen out of it instead."""
    status = main()
    gc.freeze()
    sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":  # its options belong to Accelerate's launcher and the script

        return launch_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"hf-elixir {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
