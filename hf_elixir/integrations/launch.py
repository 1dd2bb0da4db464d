"""``hf-elixir config`` and ``hf-elixir launch``: accelerate config files with an ``elixir:`` section.

Accelerate's config loader rejects unknown top-level keys, so a file with an ``elixir:``
section is only read here: ``launch`` checks the section (an unknown key or bad value stops
it before any worker starts), takes it out, exports it as ``ELIXIR_*`` variables with
``ACCELERATE_USE_ELIXIR=true``, writes Accelerate a config it accepts, and hands over to
Accelerate's own launcher with each worker started through ``hf_elixir.integrations.bootstrap``
(which installs the elixir classes, then runs the user's script unmodified).

On a machine without GPUs, Accelerate starts several CPU processes only through MPI; the
launcher starts them with torchrun instead (the same code path as GPUs) and tells every
worker to use the CPU, so ``MULTI_CPU`` with gloo is what the script sees.
"""

from __future__ import annotations

import os
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin
from hf_elixir.runtime.host_memory import TUNABLE_ENV, rank_tunables
from hf_elixir.vocab import HfElixirError

BOOTSTRAP = "hf_elixir.integrations.bootstrap"
SECTION = "elixir"
SHARDING_TYPES = ("DEEPSPEED", "FSDP", "MEGATRON_LM")


class LaunchError(HfElixirError, RuntimeError):
    """The launch could not start, or a worker failed; the message says which and why."""


@dataclass
class LaunchConfig:
    """An accelerate config split into Accelerate's part and hf_elixir's plugin."""

    accelerate: dict[str, Any]
    plugin: ElixirPlugin
    source: Path


def read_config(path: str | os.PathLike) -> LaunchConfig:
    """Read and check an accelerate config YAML with an ``elixir:`` section."""
    source = Path(path)
    try:
        data = yaml.safe_load(source.read_text())
    except OSError as e:
        raise LaunchError(f"cannot read config file {source}: {e}") from None
    except yaml.YAMLError as e:
        raise LaunchError(f"{source} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise LaunchError(f"{source} is not an accelerate config (a YAML mapping)")
    data = dict(data)
    section = data.pop(SECTION, None)
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise LaunchError(f"{source}: the '{SECTION}:' section must be a mapping of options")
    try:
        plugin = ElixirPlugin.from_dict(section)
    except ElixirConfigError as e:
        raise LaunchError(f"{source}: {e}") from None
    kind = str(data.get("distributed_type", "NO")).upper()
    if kind in SHARDING_TYPES or data.get("deepspeed_config") or data.get("fsdp_config"):
        raise LaunchError(
            f"{source}: distributed_type {kind} (or a deepspeed/fsdp section) shards the model too; "
            "hf_elixir replaces it: use MULTI_GPU, MULTI_CPU or NO"
        )
    check_machines(data, source)
    return LaunchConfig(accelerate=data, plugin=plugin, source=source)


def default_config(num_processes: int, mixed_precision: str = "no", use_gpu: Optional[bool] = None,
                   main_process_port: Optional[int] = None, num_machines: int = 1, machine_rank: int = 0,
                   main_process_ip: Optional[str] = None) -> dict[str, Any]:
    """Accelerate's part of a config: ``num_processes`` in all, over ``num_machines`` machines
    (Accelerate's convention: each machine starts ``num_processes // num_machines``)."""
    if use_gpu is None:
        import torch

        use_gpu = torch.cuda.is_available()
    several = num_processes > 1 or num_machines > 1
    kind = "NO" if not several else ("MULTI_GPU" if use_gpu else "MULTI_CPU")
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": kind,
        "num_machines": int(num_machines),
        "machine_rank": int(machine_rank),
        "num_processes": int(num_processes),
        "mixed_precision": mixed_precision,
        "use_cpu": not use_gpu,
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
    }
    if main_process_ip is not None:
        cfg["main_process_ip"] = str(main_process_ip)
    if main_process_port is not None:
        cfg["main_process_port"] = int(main_process_port)
    check_machines(cfg, "the config")
    return cfg


def check_machines(acc: dict[str, Any], source: object) -> None:
    """A multi-machine config names the main machine and gives every machine the same number
    of processes; say what is missing before any process starts."""
    try:
        machines = int(acc.get("num_machines", 1) or 1)
        rank = int(acc.get("machine_rank", 0) or 0)
        procs = int(acc.get("num_processes", 1) or 1)
    except (TypeError, ValueError) as e:
        raise LaunchError(f"{source}: num_machines, machine_rank and num_processes must be integers ({e})") from None
    if machines < 1:
        raise LaunchError(f"{source}: num_machines must be at least 1, got {machines}")
    if machines == 1:
        return
    if not 0 <= rank < machines:
        raise LaunchError(f"{source}: machine_rank {rank} is not one of 0..{machines - 1} "
                          f"(num_machines {machines}); the main machine is 0")
    if procs % machines:
        raise LaunchError(f"{source}: num_processes is the total over all machines ({procs}) and must be "
                          f"divisible by num_machines ({machines}): each machine starts the same number")
    if not acc.get("main_process_ip"):
        raise LaunchError(f"{source}: num_machines {machines} needs main_process_ip, the address every machine "
                          "reaches machine 0 at (and the same main_process_port on each)")


def write_config(path: str | os.PathLike, accelerate_cfg: dict[str, Any], plugin: ElixirPlugin) -> Path:
    """Write the YAML (Accelerate's keys, then the ``elixir:`` section of set options)."""
    section = {k: v for k, v in plugin.options().items() if v is not None}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(accelerate_cfg, sort_keys=False)
    text += yaml.safe_dump({SECTION: section}, sort_keys=False, default_flow_style=False)
    out.write_text(text)
    return out


def accelerate_view(cfg: LaunchConfig, cuda: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The config Accelerate is given, and extra environment for the workers.

    Several CPU processes are started like GPU ones (torchrun) and told to use the CPU.
    CPU ranks start with glibc's per-thread cache off, or their heap fragments step after
    step (``hf_elixir/runtime/host_memory.py``).
    """
    acc = dict(cfg.accelerate)
    env: dict[str, str] = {}
    kind = str(acc.get("distributed_type", "NO")).upper()
    several = int(acc.get("num_processes", 1) or 1) > 1 or int(acc.get("num_machines", 1) or 1) > 1
    if several and (kind == "MULTI_CPU" or not cuda) and not acc.get("mpirun_config"):
        acc["distributed_type"] = "MULTI_GPU"
        acc["use_cpu"] = False
        env["ACCELERATE_USE_CPU"] = "true"
    if not cuda or kind == "MULTI_CPU" or acc.get("use_cpu"):
        env[TUNABLE_ENV] = rank_tunables(os.environ.get(TUNABLE_ENV, ""))
    return acc, env


def launch(config_file: str | os.PathLike, argv: list[str]) -> None:
    """Validate, then run ``accelerate launch`` semantics with the elixir bootstrap.

    ``argv``: Accelerate launcher options (``--num_processes``, ``--main_process_port``, ...)
    followed by the script and its arguments.
    """
    import torch
    from accelerate.commands.launch import launch_command, launch_command_parser

    cfg = read_config(config_file)
    parser = launch_command_parser()
    try:
        args = parser.parse_args(["--config_file", str(config_file), *argv])
    except SystemExit as e:
        raise LaunchError("could not parse the launcher arguments (see above)") from e
    if not args.training_script:
        raise LaunchError("name the training script: hf-elixir launch --config_file FILE script.py [args]")
    if args.module or args.no_python:
        raise LaunchError("hf-elixir launch runs a Python script file; --module/--no_python are not supported")
    if getattr(args, "use_deepspeed", False) or getattr(args, "use_fsdp", False):
        raise LaunchError("--use_deepspeed/--use_fsdp shard the model too; hf_elixir replaces them")
    if not Path(args.training_script).is_file():
        raise LaunchError(f"no script {args.training_script}")
    acc, extra_env = accelerate_view(cfg, torch.cuda.is_available())
    env = {**cfg.plugin.to_env(), **extra_env}
    with tempfile.TemporaryDirectory(prefix="hf_elixir_launch_") as tmp:
        plain = Path(tmp) / "accelerate_config.yaml"
        plain.write_text(yaml.safe_dump(acc, sort_keys=False))
        args.config_file = str(plain)
        args.module = True
        args.training_script_args = [args.training_script, *args.training_script_args]
        args.training_script = BOOTSTRAP
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            launch_command(args)
        except Exception as e:  # torch's ChildFailedError carries which ranks died and how
            failures = getattr(e, "failures", None)
            if failures:
                raise LaunchError(describe_failures(failures)) from None
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def describe_failures(failures: dict) -> str:
    """One line per failed rank: which rank, how it ended; the other workers were stopped."""
    lines = []
    for rank, failure in sorted(failures.items()):
        code = getattr(failure, "exitcode", None)
        how = f"exit code {code}"
        if isinstance(code, int) and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        pid = getattr(failure, "pid", None)
        lines.append(f"worker rank {rank} (pid {pid}) failed: {how}")
    lines.append("the launcher stopped the remaining workers; see their output above for the first error")
    return "\n".join(lines)
