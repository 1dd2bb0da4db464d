"""Worker entry point of ``hf-elixir launch``: install the elixir classes, then run the script.

    python -m hf_elixir.integrations.bootstrap script.py [args...]

Scripts find ``Accelerator``, ``Trainer`` and ``TrainingArguments`` by name in the
``accelerate`` and ``transformers`` packages; giving those names the elixir subclasses
before the script reads them gives an unmodified script the hf_elixir runtime. The
subclasses stay plain Accelerate/Trainer classes unless ``ACCELERATE_USE_ELIXIR`` is true.

The names are installed when the script first reads them, not before it starts: importing
the Trainer costs seconds per worker (transformers' trainer module pulls in PEFT,
bitsandbytes and parts of torch's compiler), and a script written against Accelerate alone,
or against torch alone, should not pay it on every rank. A package the script never imports
is never imported. The script runs through ``process_exit.run_script``, so a worker that
finished its work ends with the script's status even when gloo threads outlive its process
groups.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Optional, Sequence

from hf_elixir.integrations.process_exit import run_script

#: package -> public name -> (module defining the original, hf_elixir module, elixir class)
REPLACEMENTS: dict[str, dict[str, tuple[str, str, str]]] = {
    "accelerate": {"Accelerator": ("accelerate.accelerator", "hf_elixir.integrations.accelerate", "ElixirAccelerator")},
    "transformers": {
        "Trainer": ("transformers.trainer", "hf_elixir.integrations.trainer", "ElixirTrainer"),
        "TrainingArguments": ("transformers.training_args", "hf_elixir.integrations.trainer",
                              "ElixirTrainingArguments"),
    },
}
#: modules that import a replaced name at their top and must keep the original, as they did
#: when every name was installed before the script ran: the Trainer builds its accelerator
#: by this name (``ElixirTrainer`` points it at ``ElixirAccelerator`` for that one call)
KEEP_ORIGINAL: dict[str, tuple[str, str]] = {"transformers.trainer": ("accelerate", "Accelerator")}

def _original(package: str, name: str) -> Any:
    return getattr(importlib.import_module(REPLACEMENTS[package][name][0]), name)


def _package_objects(package: str, module: types.ModuleType) -> list[types.ModuleType]:
    """``module`` and the object ``sys.modules`` holds for ``package``, once each: a lazy
    module may put a new object there while the package loads."""
    return list({id(m): m for m in (module, sys.modules.get(package)) if m is not None}.values())


def _resolver(package: str):
    """What a replaced name of ``package`` reads as: its elixir class, imported on first read
    and then set on the module that was asked (and on the one ``sys.modules`` holds); while
    the hf_elixir module defining it is itself loading (a script may import it first), the
    package's own class, left unset so the next read resolves again."""
    names = REPLACEMENTS[package]

    def resolve(name: str, asked: types.ModuleType) -> Any:
        _, where, cls_name = names[name]
        loaded = sys.modules.get(where)
        if loaded is not None and not hasattr(loaded, cls_name):
            # our module is loading (through this very read, or imported by the script
            # directly) and imports the original it subclasses
            return _original(package, name)
        value = getattr(importlib.import_module(where), cls_name)
        for target in _package_objects(package, asked):
            setattr(target, name, value)
        return value

    return resolve


def _module_getattr(package: str, module: types.ModuleType):
    """A module-level ``__getattr__`` (PEP 562) answering the replaced names of ``package``."""
    resolve = _resolver(package)

    def __getattr__(name: str) -> Any:
        if name not in REPLACEMENTS[package]:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return resolve(name, module)

    return __getattr__


def _class_getattr(package: str, cls: type) -> None:
    """Answer the replaced names of ``package`` from the ``__getattr__`` of its module's
    class, ahead of that class's own. For a module type of its own (transformers' lazy
    module): a new module object of it may replace the package in ``sys.modules`` after the
    import (transformers' ``processing_utils`` loads the package afresh), and the class
    answers for that one too. Only modules named ``package`` are affected."""
    inner = getattr(cls, "__getattr__", None)
    if getattr(inner, "_hf_elixir_package", None) == package:
        return
    resolve = _resolver(package)

    def __getattr__(self: types.ModuleType, name: str) -> Any:
        if name in REPLACEMENTS[package] and self.__dict__.get("__name__") == package:
            return resolve(name, self)
        if inner is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return inner(self, name)

    __getattr__._hf_elixir_package = package  # type: ignore[attr-defined]
    cls.__getattr__ = __getattr__  # type: ignore[method-assign]


def _defer_names(package: str, module: types.ModuleType) -> None:
    """Route the replaced names of an imported ``package`` to the elixir classes, read on
    first use (the originals stay in the modules that define them)."""
    for target in _package_objects(package, module):
        for name in REPLACEMENTS[package]:
            target.__dict__.pop(name, None)
        if type(target) is types.ModuleType:
            target.__dict__["__getattr__"] = _module_getattr(package, target)
        else:
            _class_getattr(package, type(target))


def _after_import(name: str, module: types.ModuleType) -> None:
    if name in REPLACEMENTS:
        _defer_names(name, module)
    if name in KEEP_ORIGINAL:
        package, attr = KEEP_ORIGINAL[name]
        setattr(module, attr, _original(package, attr))


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds nothing itself: when a module of ``REPLACEMENTS`` or ``KEEP_ORIGINAL`` is
    imported, its own loader runs it and then ``_after_import`` changes its names."""

    def __init__(self) -> None:
        self._loaders: dict[str, importlib.abc.Loader] = {}

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in REPLACEMENTS and fullname not in KEEP_ORIGINAL:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have found it (an editable install's finder too)
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        self._loaders[fullname] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        loader = self._loaders[module.__name__]
        # the module sees its real loader (resources, source lookups) from the start
        module.__spec__.loader = module.__loader__ = loader
        loader.exec_module(module)
        _after_import(module.__name__, module)


def install() -> None:
    """Give ``accelerate.Accelerator``, ``transformers.Trainer`` and
    ``transformers.TrainingArguments`` the elixir subclasses, each when first read (a
    package imported already is changed at once)."""
    for name in (*REPLACEMENTS, *KEEP_ORIGINAL):
        if name in sys.modules:
            _after_import(name, sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m hf_elixir.integrations.bootstrap script.py [args...]")
    script, *rest = argv
    install()
    run_script(script, rest)


if __name__ == "__main__":
    main()
