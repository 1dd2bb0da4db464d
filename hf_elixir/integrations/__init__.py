"""hf_elixir inside Accelerate and the Transformers Trainer (docs/design.md, "Integrations").

``ElixirPlugin`` (options), ``ElixirAccelerator`` and ``ElixirTrainer`` /
``ElixirTrainingArguments``; ``launch.py`` backs ``hf-elixir config`` and ``hf-elixir launch``.
Names are imported lazily so that ``import hf_elixir.integrations`` does not pull in
transformers when only the plugin or the launcher is needed.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ElixirPlugin": "plugin",
    "ElixirConfigError": "plugin",
    "ElixirAccelerator": "accelerate",
    "ElixirTrainer": "trainer",
    "ElixirTrainingArguments": "trainer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
    return getattr(module, name)
