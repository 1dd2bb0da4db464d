"""Which compile the user asked for, read from every place one can ask.

Accelerate gathers the Trainer's ``torch_compile`` / ``torch_compile_backend`` /
``torch_compile_mode``, its own ``dynamo_backend`` argument, ``--dynamo_backend`` and the
config file's ``dynamo_config`` into one ``TorchDynamoPlugin`` on the accelerator's state;
the ``elixir:`` section's ``compile`` option is the other place. A plain Accelerator then
calls ``torch.compile`` on the prepared model; the ElixirAccelerator must hand the same
request to the runtime, which compiles each block with the chunk hooks outside
(``runtime/compiled.py``), or the request would be dropped without a word.
"""

from __future__ import annotations

from typing import Any, Optional

from hf_elixir.runtime.compiled import CompileOptions

#: said once per process when Accelerate asked to compile the whole model
WHOLE_MODEL_NOTE = ("hf_elixir: Accelerate asked to torch.compile the whole model; under hf_elixir each "
                    "repeated block is compiled instead (regional compilation), since a whole-model graph "
                    "would trace the chunk gathers and releases that run between blocks")


def compile_request(dynamo_plugin: Any, elixir_compile: Any) -> tuple[Optional[CompileOptions], Optional[str]]:
    """The compile options to run with, and a note to print (or None).

    ``dynamo_plugin``: Accelerate's ``TorchDynamoPlugin`` (or None); ``elixir_compile``: the
    plugin's ``compile`` option. Accelerate's request wins where both are set, since the
    Trainer's and the launcher's flags are the more specific."""
    backend = getattr(dynamo_plugin, "backend", None)
    name = str(getattr(backend, "value", backend) or "no").lower()
    if name != "no" and not getattr(dynamo_plugin, "disable", False):
        mode = getattr(dynamo_plugin, "mode", None)
        options = CompileOptions(
            backend=name, mode=None if mode in (None, "default") else mode,
            fullgraph=bool(getattr(dynamo_plugin, "fullgraph", False)),
            dynamic=getattr(dynamo_plugin, "dynamic", None), options=getattr(dynamo_plugin, "options", None))
        note = None if getattr(dynamo_plugin, "use_regional_compilation", False) else WHOLE_MODEL_NOTE
        return options, note
    return CompileOptions.parse(elixir_compile), None
