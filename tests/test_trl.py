"""TRL's SFTTrainer, unmodified, under `hf-elixir launch` against plain `accelerate launch` (DDP).

SFTTrainer computes its loss with a fused LM head that reads
``model.get_output_embeddings().weight`` directly instead of calling the head module, so no
module hook gathers that weight's chunk: the read itself must (issue 26). The runs pin a
plan whose rCache is smaller than the chunk count, so the head's chunk is released when the
loss reads it (the script's probe shows it was, at every call), and each case must match the
DDP reference in logged losses and grad norms, the evaluation, and the saved weights or
adapter. Four cases: GPT-2 (tied head: the read is of the input embedding's chunk, evicted
since the forward began) and a Llama-style model (untied head: a weight no module of the
forward ever gathers), each fully fine-tuned and with a LoRA adapter (frozen chunks).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from harness import free_port
from hf_elixir.integrations.launch import accelerate_view, default_config, read_config, write_config
from hf_elixir.integrations.plugin import ElixirPlugin
from integration_helpers import SCRIPTS, accelerate_launch, elixir_launch

SCRIPT = "trl_sft.py"
# Pinned plan (the config's `elixir:` section): chunks of ~4096 fp32 elements give 7 to 14
# chunks for these models, and 3 rCache blocks are the planner's own minimum for the tightest
# case (GPT-2, full fine-tune: 2 is refused), the tight-memory case the automatic planner
# reaches. The head's chunk, held from the fused loss's read to the end of backward, then
# takes a block beyond the plan (the runtime warns).
ELIXIR_OPTIONS = dict(chunk_size_mb=0.016, rcache_blocks=3)
# SFTConfig defaults (gradient checkpointing on, lr schedule, clipping at 1.0, ...) except:
# fp32 on a CPU, 3 logged steps, and a learning rate high enough that 3 Adam steps move every
# trained weight by ~2e-3, far above the tolerance the weights are compared with.
SFT_ARGS = ["--bf16", "false", "--max_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "2",
            "--per_device_eval_batch_size", "4", "--learning_rate", "1e-3", "--report_to", "none",
            "--seed", "0", "--disable_tqdm", "true"]
CASES = [("gpt2", False), ("llama", False), ("gpt2", True), ("llama", True)]
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy")
WEIGHT_TOL = 2e-6


def _script_module():
    """The script's own model builder, so the test loads adapters onto the same base."""
    spec = importlib.util.spec_from_file_location("trl_sft_script", SCRIPTS / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl_configs")
    write_config(d / "elixir.yaml", default_config(2, use_gpu=False), ElixirPlugin(**ELIXIR_OPTIONS))
    plain, _ = accelerate_view(read_config(d / "elixir.yaml"), cuda=False)
    (d / "plain.yaml").write_text(yaml.safe_dump(plain))
    return d / "elixir.yaml", d / "plain.yaml"


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{'lora' if l else 'full'}" for a, l in CASES])
def runs(request, configs, tmp_path_factory):
    """One case run twice, with the same script and arguments: plain DDP, then hf_elixir."""
    arch, lora = request.param
    d = tmp_path_factory.mktemp(f"trl_{arch}_{'lora' if lora else 'full'}")
    args = ["--arch", arch, "--lora", str(lora).lower(), *SFT_ARGS]
    accelerate_launch(configs[1], free_port(), SCRIPT, "--output_dir", str(d / "plain"),
                      "--result", str(d / "plain.pt"), *args, cwd=d)
    proc = elixir_launch(configs[0], free_port(), SCRIPT, "--output_dir", str(d / "elixir"),
                         "--result", str(d / "elixir.pt"), *args, cwd=d)
    load = lambda name: torch.load(d / name, weights_only=False)  # noqa: E731
    return arch, lora, load("plain.pt"), load("elixir.pt"), proc


def test_runs_are_what_they_claim(runs) -> None:
    """The elixir run really ran on the runtime (an ElixirTrainer under SFTTrainer, the model
    an ElixirModule, the launcher's banner), with fewer rCache blocks than chunks, while the
    reference is plain DDP; both went through TRL's fused LM head in training and evaluation,
    and under hf_elixir the head's weight was a released parameter at every call."""
    arch, lora, plain, elixir, proc = runs
    assert "hf_elixir is active on 2 process(es)" in proc.stdout
    assert elixir["is_elixir"] and elixir["wrapped"] == "ElixirModule" and elixir["world"] == 2
    assert elixir["trainer_mro"][0] == "SFTTrainer" and "ElixirTrainer" in elixir["trainer_mro"]
    assert not plain["is_elixir"] and plain["wrapped"] == "DistributedDataParallel" and plain["world"] == 2
    assert "ElixirTrainer" not in plain["trainer_mro"] and plain["chunks"] is None
    assert elixir["rcache_blocks"] == ELIXIR_OPTIONS["rcache_blocks"] < elixir["chunks"]
    assert plain["global_step"] == elixir["global_step"] == 3
    for run in (plain, elixir):
        probe = run["probe"]
        assert probe["grad_calls"] == 3 and probe["calls"] == 4  # 3 training steps, 1 evaluation batch
        assert probe["weight_shapes"] == {(96, 32)}
    assert plain["probe"]["released_at_call"] == 0
    assert elixir["probe"]["released_at_call"] == elixir["probe"]["calls"]


def test_logged_losses_and_grad_norms_match(runs) -> None:
    _, _, plain, elixir, _ = runs
    steps = lambda run: [h for h in run["log_history"] if "loss" in h]  # noqa: E731
    assert len(steps(plain)) == len(steps(elixir)) == 3
    for p, e in zip(steps(plain), steps(elixir)):
        assert p["step"] == e["step"]
        for key in LOGGED:
            assert e[key] == pytest.approx(p[key], rel=1e-5, abs=1e-7), (p["step"], key, p[key], e[key])
    assert steps(plain)[0]["grad_norm"] > 0
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert elixir["eval"][key] == pytest.approx(plain["eval"][key], rel=1e-5), key


def test_saved_weights_or_adapter_match(runs) -> None:
    """Full fine-tune: the saved folders load with from_pretrained and hold the same weights.
    LoRA: the saved adapters load with PeftModel.from_pretrained onto the same base and hold
    the same adapter weights. Either way the training moved the weights far more than the
    tolerance, so a gradient missing from one chunk could not pass unseen."""
    arch, lora, plain, elixir, _ = runs
    build = _script_module().build_model
    initial = build(arch).state_dict()

    def load(run):
        if lora:
            return PeftModel.from_pretrained(build(arch), run["final"]).state_dict()
        return AutoModelForCausalLM.from_pretrained(run["final"]).state_dict()

    saved_plain, saved_elixir = load(plain), load(elixir)
    assert set(saved_plain) == set(saved_elixir)
    trained = [k for k in saved_plain if "lora_" in k] if lora else list(saved_plain)
    assert trained
    diff = max((saved_elixir[k] - saved_plain[k]).abs().max().item() for k in trained)
    assert diff < WEIGHT_TOL, diff
    if lora:
        moved = max(saved_plain[k].abs().max().item() for k in trained if "lora_B" in k)  # lora_B starts at 0
        # the frozen base, held in frozen chunks, is the initial model still
        held = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                for k, v in elixir["state"].items() if "lora_" not in k}
        assert held.keys() == initial.keys()
        assert all(torch.equal(v, initial[k]) for k, v in held.items()), "the frozen base changed"
    else:
        moved = max((saved_plain[k] - initial[k]).abs().max().item() for k in trained)
    assert moved > 100 * WEIGHT_TOL, moved
    # the weights the trainer holds at the end (gathered by get_state_dict) agree too
    assert set(plain["state"]) == set(elixir["state"])
    assert max((plain["state"][k] - elixir["state"][k]).abs().max().item() for k in plain["state"]) < WEIGHT_TOL
