"""``hf-elixir config`` and ``hf-elixir launch`` (the command-line side of integrations/launch.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

from hf_elixir.cli.common import CLIError
from hf_elixir.integrations.launch import LaunchError, default_config, launch, write_config
from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin, option_fields, option_help

DEFAULT_CONFIG = "elixir_accelerate.yaml"


# ---------------------------------------------------------------------- config
def register_config(sub) -> None:
    p = sub.add_parser(
        "config", help="write an accelerate config file with an elixir: section",
        description="Write an accelerate config YAML plus an 'elixir:' section for `hf-elixir launch`. "
                    "Asks each question unless --non-interactive; flags given are not asked.")
    p.add_argument("--config_file", default=DEFAULT_CONFIG, help=f"where to write it (default {DEFAULT_CONFIG})")
    p.add_argument("--non-interactive", "--non_interactive", dest="non_interactive", action="store_true",
                   help="take flags and defaults, ask nothing")
    p.add_argument("--num_processes", type=int, default=None,
                   help="processes in all, over every machine (one per GPU)")
    p.add_argument("--num_machines", type=int, default=None, help="machines the run spans (default 1)")
    p.add_argument("--machine_rank", type=int, default=None,
                   help="this machine's rank, 0 for the main one (write one file per machine)")
    p.add_argument("--main_process_ip", default=None, help="the address every machine reaches machine 0 at")
    p.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), default=None)
    p.add_argument("--main_process_port", type=int, default=None)
    p.add_argument("--use_cpu", action="store_true", default=None, help="train on the CPU even if GPUs exist")
    for f in option_fields():
        p.add_argument(f"--{f.name}", default=None, help=option_help(f.name))
    p.set_defaults(func=cmd_config)


def _ask(question: str, default: Any, cast: Callable[[str], Any] = str) -> Any:
    while True:
        answer = input(f"{question} [{default}]: ").strip()
        if not answer:
            return default
        try:
            return cast(answer)
        except (ValueError, ElixirConfigError) as e:
            print(f"  {e}; try again", file=sys.stderr)


def cmd_config(args) -> int:
    import torch

    gpus = torch.cuda.device_count()
    use_gpu = gpus > 0 and not args.use_cpu
    interactive = not args.non_interactive and sys.stdin.isatty()
    machines = _setting(args.num_machines, 1, interactive, "How many machines will the run span?", int)
    rank, ip, port = args.machine_rank, args.main_process_ip, args.main_process_port
    if machines > 1:
        rank = _setting(rank, 0, interactive, "The rank of this machine (0: the main one)?", int)
        ip = _setting(ip, None, interactive, "The IP address of the main machine (machine 0)?")
        port = _setting(port, 29500, interactive, "The port on the main machine the others connect to?", int)
    per_machine = gpus if use_gpu else 2
    num = _setting(args.num_processes, per_machine * machines, interactive,
                   "How many processes in all, over every machine (one per GPU)?", int)
    if num < 1:
        raise CLIError("--num_processes must be at least 1")
    precision = _setting(args.mixed_precision, "bf16" if use_gpu else "no", interactive,
                         "Precision (no, bf16, fp16)?",
                         lambda s: s if s in ("no", "bf16", "fp16") else _raise(ValueError(f"{s!r} is not no/bf16/fp16")))
    options = {f.name: getattr(args, f.name) for f in option_fields()}
    if interactive:
        for name, question in (("gpu_memory", "Memory per device for the plan (blank: all of it)?"),
                               ("offload", "Offload optimizer state to CPU (auto, none, all, 0-1)?"),
                               ("activation_checkpointing", "Activation checkpointing (auto, on, off)?")):
            if options[name] is None:
                default = "auto" if name != "gpu_memory" else None
                options[name] = _ask(question, default, lambda s, n=name: _checked(n, s))
    try:
        plugin = ElixirPlugin.from_dict({k: v for k, v in options.items() if v is not None})
        accelerate_cfg = default_config(num, precision, use_gpu, port, num_machines=machines,
                                        machine_rank=rank or 0, main_process_ip=ip)
    except (ElixirConfigError, LaunchError) as e:
        raise CLIError(str(e)) from None
    path = write_config(args.config_file, accelerate_cfg, plugin)
    print(f"wrote {path}; start training with:\n  hf-elixir launch --config_file {path} your_script.py [args]")
    if machines > 1:
        print(f"  on each of the {machines} machines, with a copy of the file whose machine_rank is that "
              f"machine's (0..{machines - 1}); checkpoints need a folder every machine sees")
    return 0


def _setting(given: Any, default: Any, interactive: bool, question: str, cast: Callable[[str], Any] = str) -> Any:
    """A flag's value when given, else the answer to ``question`` (interactive) or ``default``."""
    if given is not None:
        return given
    return _ask(question, default, cast) if interactive else default


def _raise(e: Exception):
    raise e


def _checked(name: str, value: str) -> str:
    ElixirPlugin.from_dict({name: value})  # raises with the reason
    return value


# ---------------------------------------------------------------------- launch
LAUNCH_USAGE = """usage: hf-elixir launch --config_file FILE [accelerate launch options] script.py [script args]

Check the config's elixir: section, then start script.py on every process like
`accelerate launch` does, with hf_elixir installed in each worker (unmodified Accelerate and
Trainer scripts get the runtime). Accelerate's own options (--num_processes,
--main_process_port, ...) go before the script."""


def register_launch(sub) -> None:
    # Parsed by hand (launch_main): everything after the config file belongs to Accelerate's
    # launcher or to the script, which argparse cannot separate for us.
    sub.add_parser("launch", help="run a training script under hf_elixir (accelerate launch semantics)",
                   add_help=False)


def split_config_file(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """Take ``--config_file FILE`` (or ``=FILE``) out of the launcher options before the script."""
    rest: list[str] = []
    config = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config_file", "--config-file") and i + 1 < len(argv):
            config = argv[i + 1]
            i += 2
            continue
        if arg.startswith(("--config_file=", "--config-file=")):
            config = arg.split("=", 1)[1]
            i += 1
            continue
        if not arg.startswith("-"):  # the script: the rest is its own
            rest.extend(argv[i:])
            break
        rest.append(arg)
        i += 1
    return config, rest


def launch_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(LAUNCH_USAGE)
        return 0 if argv else 2
    config, rest = split_config_file(argv)
    if config is None:
        print("hf-elixir launch: error: --config_file FILE is required (write one with `hf-elixir config`)",
              file=sys.stderr)
        return 2
    if not Path(config).is_file():
        print(f"hf-elixir launch: error: no config file {config}", file=sys.stderr)
        return 2
    try:
        launch(config, rest)
    except LaunchError as e:
        print(f"hf-elixir launch: error: {e}", file=sys.stderr)
        return 1
    return 0
