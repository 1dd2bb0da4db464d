"""ElixirPlugin: the options a user sets for hf_elixir under Accelerate or the Trainer.

One dataclass serves every way in: keyword arguments, a dict (the ``elixir:`` section of an
accelerate config YAML, or ``--elixir_config '{...}'``), and ``ELIXIR_*`` environment
variables, which is how ``hf-elixir launch`` hands the YAML section to each worker. Every
value is checked in ``__post_init__`` so a bad option fails before any worker shards a model.

This module imports neither accelerate nor transformers: the launcher validates a config
with it before it starts anything.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional, Union

from hf_elixir.hardware import HardwareError, HardwareProfile, parse_memory
from hf_elixir.runtime.compiled import CompileError, CompileOptions
from hf_elixir.runtime.disk_tier import DiskTierError, check_path
from hf_elixir.vocab import BARE_MINIMUM, HfElixirError

USE_ENV = "ACCELERATE_USE_ELIXIR"
ENV_PREFIX = "ELIXIR_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")
OFFLOAD_WORDS = ("auto", "none", "all")
CHECKPOINTING_WORDS = ("auto", "on", "off")
EFFICIENCY_WORDS = ("auto", "measure", "calibrated")


class ElixirConfigError(HfElixirError, ValueError):
    """An hf_elixir option with an unknown name or a value it cannot take."""


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean environment variable; anything but a clear yes/no is an error."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ElixirConfigError(f"{name}={raw!r} is not a boolean; use true or false")


def elixir_requested() -> bool:
    """Whether the environment (``ACCELERATE_USE_ELIXIR``) switches hf_elixir on."""
    return env_flag(USE_ENV)


def _option(help: str, default: str) -> Any:
    """A plugin option: unset (None) until given or read from the environment. Its help and
    the words for its default are kept here, once: the CLI's flags and the README's options
    table are made from them (``options_table``; a test keeps the README's copy equal)."""
    return field(default=None, metadata={"help": help, "default": default})


@dataclass
class ElixirPlugin:
    """How hf_elixir plans and runs; every field left unset reads ``ELIXIR_<FIELD>``.

    Each field's help is on the field itself (``options_table()`` renders them). Pinning any
    of ``chunk_size_mb``, ``rcache_blocks``, ``offload`` or ``activation_checkpointing``
    replaces the search by a fixed plan (``ElixirPlan.simple``) built from the pinned values,
    because the search has no notion of a partly fixed plan.
    """

    plan: Optional[str] = _option(
        "`auto` (profile and search) or a plan JSON from `hf-elixir plan --json`", "`auto`")
    gpu_memory: Optional[str] = _option("memory per device the plan may use (`24GiB`, `80GB`)", "the device's")
    hardware: Optional[str] = _option("a preset for the cost model (`a100-80g`, `h100-80g`, `cpu`, ...)", "this machine")
    chunk_size_mb: Optional[float] = _option("pin the chunk size, in MiB", "searched")
    rcache_blocks: Optional[int] = _option("pin the number of gathered chunks kept (rCache blocks)", "searched")
    offload: Optional[Union[str, float]] = _option(
        "`auto`, `none`, `all`, or the fraction of optimizer state in CPU memory (0-1)", "`auto`")
    nvme_path: Optional[str] = _option(
        "a directory on a fast local disk for the optimizer state a plan keeps on disk (the disk tier; "
        "docs/design.md)", "none")
    activation_checkpointing: Optional[str] = _option("`auto`, `on` or `off`", "`auto`")
    batch_size: Optional[int] = _option("the per-device micro-batch to plan for", "the first training batch")
    seq_len: Optional[int] = _option("the sequence length to plan for", "the first training batch")
    logit_piece_tokens: Optional[int] = _option(
        "run the LM head and its loss over this many tokens at a time, so the whole logits never exist "
        "(`0`: whole logits; docs/design.md, long context)", "the plan's")
    efficiency: Optional[Union[str, float]] = _option(
        "how the search prices compute: `auto` (time the model first on a calibrated machine), "
        "`measure`, `calibrated`, or a number", "`auto`")
    recover_oom: Optional[Union[str, bool]] = _option(
        "re-plan and redo a step that runs out of memory instead of stopping (docs/recovery.md)", "`true`")
    compile: Optional[Union[str, bool]] = _option(
        "torch.compile each decoder block, hooks outside: `true` (inductor), a backend name, or `false`; "
        "the Trainer's `torch_compile` and Accelerate's `dynamo_backend` ask for it too", "`false`")
    _from_env: list[str] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in option_fields():
            if getattr(self, f.name) is None:
                raw = os.environ.get(env_name(f.name))
                if raw is not None and raw != "":
                    setattr(self, f.name, raw)
                    self._from_env.append(f.name)
        self.plan = self.plan or "auto"
        self.offload = _offload(self.offload if self.offload is not None else "auto")
        self.activation_checkpointing = _checkpointing(
            self.activation_checkpointing if self.activation_checkpointing is not None else "auto"
        )
        self.chunk_size_mb = _number("chunk_size_mb", self.chunk_size_mb, float, minimum=1e-6)
        self.rcache_blocks = _number("rcache_blocks", self.rcache_blocks, int, minimum=1)
        self.batch_size = _number("batch_size", self.batch_size, int, minimum=1)
        self.seq_len = _number("seq_len", self.seq_len, int, minimum=1)
        self.logit_piece_tokens = _number("logit_piece_tokens", self.logit_piece_tokens, int, minimum=0)
        self.efficiency = _efficiency(self.efficiency if self.efficiency is not None else "auto")
        self.recover_oom = _boolean("recover_oom", self.recover_oom, default=True)
        self.compile = _compile(self.compile)
        if self.nvme_path is not None:  # its free space is checked against the plan when sharding
            try:
                self.nvme_path = str(check_path(str(self.nvme_path), 0))
            except DiskTierError as e:
                raise ElixirConfigError(f"elixir option {e}") from None
        if self.gpu_memory is not None:
            try:
                parse_memory(self.gpu_memory, bare_minimum=BARE_MINIMUM)  # `gpu_memory: 24` is no budget
            except HardwareError as e:
                raise ElixirConfigError(f"elixir option gpu_memory: {e}") from None
            self.gpu_memory = str(self.gpu_memory)
        if self.hardware is not None:
            try:
                HardwareProfile.preset(str(self.hardware))
            except HardwareError as e:
                raise ElixirConfigError(f"elixir option hardware: {e}") from None
        if self.plan != "auto":
            path = Path(self.plan).expanduser()
            if not path.is_file():
                raise ElixirConfigError(
                    f"elixir option plan: {self.plan!r} is neither 'auto' nor a plan JSON file; "
                    "write one with `hf-elixir plan MODEL --json plan.json`"
                )
            self.plan = str(path)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, options: Optional[dict[str, Any]]) -> "ElixirPlugin":
        """From a dict such as the YAML ``elixir:`` section; unknown keys are an error."""
        options = dict(options or {})
        known = {f.name for f in option_fields()}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ElixirConfigError(
                f"unknown elixir option(s) {', '.join(map(repr, unknown))}; "
                f"the options are: {', '.join(sorted(known))}"
            )
        return cls(**options)

    @classmethod
    def from_json(cls, text: Union[str, dict, None]) -> "ElixirPlugin":
        """From ``--elixir_config``: a JSON object, a path to a JSON file, or a dict."""
        if text is None or isinstance(text, dict):
            return cls.from_dict(text)
        stripped = text.strip()
        if not stripped.startswith("{"):
            path = Path(stripped).expanduser()
            if not path.is_file():
                raise ElixirConfigError(
                    f"elixir_config {text!r} is neither a JSON object nor a JSON file"
                )
            stripped = path.read_text()
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ElixirConfigError(f"elixir_config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ElixirConfigError("elixir_config must be a JSON object, e.g. '{\"offload\": \"auto\"}'")
        return cls.from_dict(data)

    # ------------------------------------------------------------------ views
    def options(self) -> dict[str, Any]:
        """The options as plain values (what a YAML section or JSON would hold)."""
        return {f.name: getattr(self, f.name) for f in option_fields()}

    def to_env(self) -> dict[str, str]:
        """Environment variables that rebuild this plugin in a worker, plus the switch."""
        env = {USE_ENV: "true"}
        for name, value in self.options().items():
            if value is not None:
                env[env_name(name)] = str(value)
        return env

    @property
    def pinned(self) -> dict[str, Any]:
        """The decisions the user fixed instead of leaving them to the search."""
        out: dict[str, Any] = {}
        if self.chunk_size_mb is not None:
            out["chunk_size_mb"] = self.chunk_size_mb
        if self.rcache_blocks is not None:
            out["rcache_blocks"] = self.rcache_blocks
        if self.offload != "auto":
            out["offload"] = self.offload
        if self.activation_checkpointing != "auto":
            out["activation_checkpointing"] = self.activation_checkpointing
        return out

    def offload_fraction(self) -> float:
        """The pinned share of optimizer state in CPU memory (0 for "none" and "auto")."""
        if self.offload == "all":
            return 1.0
        if self.offload in ("none", "auto"):
            return 0.0
        return float(self.offload)


def option_fields():
    return [f for f in fields(ElixirPlugin) if not f.name.startswith("_")]


def option_help(name: str) -> str:
    """One option's help, as plain text (the CLI's flags)."""
    f = next(f for f in option_fields() if f.name == name)
    return f"{f.metadata['help']} (default: {f.metadata['default']})".replace("`", "")


def options_table() -> str:
    """The options as a Markdown table (the README carries this exact text)."""
    rows = ["| option | values | default |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {f.metadata['help']} | {f.metadata['default']} |" for f in option_fields()]
    return "\n".join(rows)


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def _boolean(name: str, value: Union[str, bool, None], default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in TRUE or word in FALSE:
        return word in TRUE
    raise ElixirConfigError(f"elixir option {name}: {value!r} is not a boolean; use true or false")


def _offload(value: Union[str, float]) -> Union[str, float]:
    return _word_or_number("offload", value, OFFLOAD_WORDS, lambda f: 0.0 <= f <= 1.0, "a fraction between 0 and 1")


def _efficiency(value: Union[str, float]) -> Union[str, float]:
    return _word_or_number("efficiency", value, EFFICIENCY_WORDS, lambda f: f > 0, "a finite, positive number")


def _word_or_number(name: str, value: Any, words: tuple[str, ...], valid: Callable[[float], bool],
                    expected: str) -> Union[str, float]:
    """One of ``words`` (any case) or a number ``valid`` accepts, else an error naming both."""
    if isinstance(value, str) and value.strip().lower() in words:
        return value.strip().lower()
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number) or not valid(number):
        raise ElixirConfigError(f"elixir option {name}: {value!r} is not one of {', '.join(words)} or {expected}")
    return number


def _compile(value: Union[str, bool, None]) -> str:
    """``off``, or the backend to compile each block with (checked against torch's list)."""
    try:
        options = CompileOptions.parse(value)
    except CompileError as e:
        raise ElixirConfigError(f"elixir option compile: {e}") from None
    return "off" if options is None else str(options.backend)


def _checkpointing(value: Union[str, bool]) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    word = str(value).strip().lower()
    word = {"true": "on", "false": "off"}.get(word, word)
    if word not in CHECKPOINTING_WORDS:
        raise ElixirConfigError(
            f"elixir option activation_checkpointing: {value!r} is not one of {', '.join(CHECKPOINTING_WORDS)}"
        )
    return word


def _number(name: str, value: Any, kind: type, minimum: float) -> Any:
    """An option's number of ``kind``, given as a number or its text: finite and at least
    ``minimum``, else an error naming the option. YAML's ``.nan`` and ``.inf`` (and ``nan``,
    ``inf`` from the environment) are refused here, before anything starts, rather than where
    planning first computes with them."""
    if value is None:
        return None
    what = "a whole number" if kind is int else "a number"
    try:
        if isinstance(value, bool):  # YAML's true/false: no count or size
            raise ValueError
        finite = math.isfinite(float(value))
    except OverflowError:  # an integer beyond any float
        finite = False
    except (TypeError, ValueError):
        raise ElixirConfigError(f"elixir option {name}: {value!r} is not {what}") from None
    if not finite:
        raise ElixirConfigError(f"elixir option {name}: {value!r} is not a finite number; "
                                f"write {what} of at least {minimum:g}")
    try:
        number = kind(value)
        if kind is int and float(value) != number:
            raise ValueError
    except (TypeError, ValueError):
        raise ElixirConfigError(f"elixir option {name}: {value!r} is not {what}") from None
    if number < minimum:
        raise ElixirConfigError(f"elixir option {name}: {value!r} must be at least {minimum:g}")
    return number
