"""Worker entry point of ``hf-elixir launch``: install the elixir classes, then run the script.

    python -m hf_elixir.integrations.bootstrap script.py [args...]

Scripts find ``Accelerator``, ``Trainer`` and ``TrainingArguments`` by name in the
``accelerate`` and ``transformers`` packages; replacing those names with the elixir
subclasses before the script runs gives an unmodified script the hf_elixir runtime. The
subclasses stay plain Accelerate/Trainer classes unless ``ACCELERATE_USE_ELIXIR`` is true.
The script runs through ``process_exit.run_script``, so a worker that finished its work
ends with the script's status even when gloo threads outlive its process groups.
"""

from __future__ import annotations

import sys

from hf_elixir.integrations.process_exit import run_script


def install() -> None:
    """Point ``accelerate.Accelerator``, ``transformers.Trainer`` and
    ``transformers.TrainingArguments`` at the elixir subclasses."""
    import accelerate
    import transformers

    from hf_elixir.integrations.accelerate import ElixirAccelerator
    from hf_elixir.integrations.trainer import ElixirTrainer, ElixirTrainingArguments

    # transformers' lazy module may put a new module object into sys.modules while loading
    # (seen with 5.x): set the names on every object a later import could return
    replacements = {
        "accelerate": {"Accelerator": ElixirAccelerator},
        "transformers": {"Trainer": ElixirTrainer, "TrainingArguments": ElixirTrainingArguments},
    }
    imported = {"accelerate": accelerate, "transformers": transformers}
    for package, names in replacements.items():
        for module in {id(m): m for m in (imported[package], sys.modules[package])}.values():
            for name, cls in names.items():
                setattr(module, name, cls)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m hf_elixir.integrations.bootstrap script.py [args...]")
    script, *rest = argv
    install()
    run_script(script, rest)


if __name__ == "__main__":
    main()
