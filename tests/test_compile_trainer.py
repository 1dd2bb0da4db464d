"""torch.compile asked for by a stock Trainer script (issue 64, acceptance 1).

The same script (tests/scripts/trainer_compile.py, dropout 0, 10 steps, 2 CPU processes,
inductor) runs under plain torchrun, where Accelerate compiles the whole model, and under
``hf-elixir launch``, where the runtime compiles each decoder block with its hooks outside.
Losses and weights must agree within the equivalence suite's tolerance, and dynamo's
counters must show that compile ran in both. GPT-2 asks through the Trainer's
``--torch_compile``; Llama's elixir run asks through the Accelerate config file's
``dynamo_config`` (regional compilation), its plain run through ``--torch_compile``.
"""

from __future__ import annotations

import sys

import pytest
import torch
import yaml

from equivalence import assert_matches
from harness import free_port
from hf_elixir.integrations.compiling import WHOLE_MODEL_NOTE
from hf_elixir.integrations.launch import default_config, write_config
from hf_elixir.integrations.plugin import ElixirPlugin
from integration_helpers import REFERENCE_SITE, SCRIPTS, check, elixir_launch, reference_env, run

SCRIPT = "trainer_compile.py"
ARGS = ["--max_steps", "10", "--per_device_train_batch_size", "2", "--learning_rate", "3e-3",
        "--adam_epsilon", "1e-6", "--weight_decay", "0.1", "--max_grad_norm", "1.0", "--logging_steps", "1",
        "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--optim", "adamw_torch",
        "--disable_tqdm", "true"]
#: how the elixir run asks for compile: the Trainer's flag, or the config file's dynamo_config
ASKED = {"gpt2": "trainer", "llama": "config"}


def torchrun(port: int, script: str, *args: str, cwd) -> None:
    """Plain torchrun, 2 processes on the CPU, ended as the suite's reference runs end."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(REFERENCE_SITE / "run_reference.py"), str(SCRIPTS / script), *args]
    check(run(cmd, cwd, reference_env(), timeout=600))


@pytest.fixture(scope="module", params=sorted(ASKED))
def runs(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(f"compile_{arch}")
    accelerate = default_config(2, use_gpu=False)
    elixir_flags = ["--torch_compile", "true"]
    if ASKED[arch] == "config":
        accelerate["dynamo_config"] = {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True}
        elixir_flags = []
    write_config(d / "elixir.yaml", accelerate, ElixirPlugin(plan="auto"))
    assert ("dynamo_config" in yaml.safe_load((d / "elixir.yaml").read_text())) == (ASKED[arch] == "config")
    torchrun(free_port(), SCRIPT, "--output_dir", str(d / "plain"), "--result", str(d / "plain.pt"),
             "--arch", arch, "--torch_compile", "true", *ARGS, cwd=d)
    proc = elixir_launch(d / "elixir.yaml", free_port(), SCRIPT, "--output_dir", str(d / "elixir"),
                         "--result", str(d / "elixir.pt"), "--arch", arch, *elixir_flags, *ARGS, cwd=d)
    plain = torch.load(d / "plain.pt")
    # torch.compile's wrapper puts its own prefix on the plain run's keys
    plain["state"] = {k.removeprefix("_orig_mod."): v for k, v in plain["state"].items()}
    return arch, plain, torch.load(d / "elixir.pt"), proc


def test_compiled_trainer_under_launch_matches_compiled_torchrun(runs) -> None:
    arch, plain, elixir, proc = runs
    assert not plain["is_elixir"] and elixir["is_elixir"] and plain["world"] == elixir["world"] == 2
    assert plain["global_step"] == elixir["global_step"] == 10
    assert len(plain["losses"]) == len(elixir["losses"]) == 10
    assert_matches(plain, elixir, label=f"{arch} compiled")


def test_compile_really_ran_in_both(runs) -> None:
    arch, plain, elixir, proc = runs
    # plain: Accelerate wrapped the whole model in torch.compile and dynamo compiled frames
    assert plain["wrapped"] == "OptimizedModule" and plain["counts"]["frames_ok"] > 0
    # elixir: the runtime compiled the decoder block once (both blocks share its code) ...
    assert elixir["wrapped"] in ("ElixirModule", "LazyElixirModule")
    assert elixir["counts"]["frames_ok"] == 1 and elixir["counts"]["unique_graphs"] == 1
    # ... said so, and compiled nothing after the first step
    assert "compile: 2 block(s)" in proc.stdout and "backend inductor" in proc.stdout
    assert (WHOLE_MODEL_NOTE in proc.stdout) == (ASKED[arch] == "trainer")
    assert all(step == elixir["per_step"][0] for step in elixir["per_step"])
    assert elixir["counts"]["recompiles"] == 0
