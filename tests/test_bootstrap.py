"""The launcher's bootstrap gives scripts the elixir classes under the names they read, when
they read them: a worker imports only what its script imports.

Each case runs in a fresh interpreter (what a worker is); both are started at once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from integration_helpers import worker_env

# a worker whose script reads the names one package at a time
STAGED = """
    import sys
    from hf_elixir.integrations.bootstrap import install
    install()
    import torch  # a torch-only script: neither package is imported for it
    assert "accelerate" not in sys.modules and "transformers" not in sys.modules, "imported up front"

    from accelerate import Accelerator
    import accelerate
    assert Accelerator.__name__ == "ElixirAccelerator" and accelerate.Accelerator is Accelerator
    assert "transformers.trainer" not in sys.modules, "an Accelerate script paid for the Trainer"

    import transformers
    from transformers import GPT2LMHeadModel
    import transformers.processing_utils  # loads the package afresh: a new module object
    assert "transformers.trainer" not in sys.modules, "a model import paid for the Trainer"
    from transformers import Trainer, TrainingArguments
    assert Trainer.__name__ == "ElixirTrainer" and TrainingArguments.__name__ == "ElixirTrainingArguments"
    assert transformers.Trainer is Trainer and sys.modules["transformers"].TrainingArguments is TrainingArguments

    # inside the packages, the originals stay where they were imported
    import accelerate.accelerator
    import transformers.trainer as trainer_module
    import transformers.training_args as args_module
    assert trainer_module.Accelerator is accelerate.accelerator.Accelerator
    assert Trainer.__mro__[1] is trainer_module.Trainer and trainer_module.Trainer.__name__ == "Trainer"
    assert TrainingArguments.__mro__[1] is args_module.TrainingArguments
    from transformers import Seq2SeqTrainer
    assert Seq2SeqTrainer.__mro__[1] is trainer_module.Trainer

    # the package still loads its resources through its own loader
    import importlib.resources
    assert importlib.resources.files("transformers").joinpath("__init__.py").is_file()
    print("staged ok")
"""

# a worker whose packages were imported, and their names read, before the bootstrap ran
EARLY = """
    import accelerate
    import transformers
    from transformers import Trainer
    assert Trainer.__name__ == "Trainer" and accelerate.Accelerator.__name__ == "Accelerator"
    from hf_elixir.integrations.bootstrap import install
    install()
    from accelerate import Accelerator
    from transformers import Trainer, TrainingArguments
    assert Accelerator.__name__ == "ElixirAccelerator"
    assert Trainer.__name__ == "ElixirTrainer" and TrainingArguments.__name__ == "ElixirTrainingArguments"
    import transformers.trainer as trainer_module
    import accelerate.accelerator
    assert trainer_module.Accelerator is accelerate.accelerator.Accelerator
    print("early ok")
"""


# a script that imports hf_elixir's integration itself first (examples/finetune_gpt2_accelerate.py)
DIRECT = """
    from hf_elixir.integrations.bootstrap import install
    install()
    from hf_elixir.integrations import ElixirAccelerator, ElixirTrainer
    import accelerate
    import accelerate.accelerator
    import transformers
    assert ElixirAccelerator.__mro__[1] is accelerate.accelerator.Accelerator
    assert accelerate.Accelerator is ElixirAccelerator and transformers.Trainer is ElixirTrainer
    print("direct ok")
"""


def test_names_are_installed_when_the_script_reads_them() -> None:
    procs = {name: subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=worker_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, code in (("staged", STAGED), ("early", EARLY), ("direct", DIRECT))}
    for name, proc in procs.items():
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0 and f"{name} ok" in out, out[-4000:]
