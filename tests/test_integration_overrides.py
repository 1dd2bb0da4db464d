"""The methods and names the integrations override still exist in the installed releases."""

from __future__ import annotations

import importlib
import inspect

import pytest

from hf_elixir.integrations.overrides import MODULE_NAMES, OVERRIDDEN


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("cls_path, name, why", OVERRIDDEN)
def test_overridden_member_exists(cls_path, name, why) -> None:
    cls = _resolve(cls_path)
    if name.startswith("_") and not callable(getattr(cls, name, None)):
        # instance attributes: set in __init__
        assert name in inspect.getsource(cls.__init__), f"{cls_path}.__init__ no longer sets {name} ({why})"
    else:
        assert hasattr(cls, name), f"{cls_path}.{name} is gone ({why}); re-check the integration"


@pytest.mark.parametrize("module, name, why", MODULE_NAMES)
def test_module_name_exists(module, name, why) -> None:
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone ({why})"


def test_every_override_is_listed() -> None:
    from accelerate import Accelerator
    from transformers import Trainer

    from hf_elixir.integrations.accelerate import ElixirAccelerator
    from hf_elixir.integrations.trainer import ElixirTrainer

    listed = {(c.rpartition(".")[2], n) for c, n, _ in OVERRIDDEN}
    for ours, base in ((ElixirAccelerator, Accelerator), (ElixirTrainer, Trainer)):
        for name, value in vars(ours).items():
            if callable(value) and hasattr(base, name) and not name.startswith("__"):
                assert (base.__name__, name) in listed, f"{ours.__name__}.{name} overrides {base.__name__} but is not listed"
