"""PEFT through every entry point (issue 25, point 3; acceptance 1 for ElixirTrainer, and 2).

Real processes throughout: plain `accelerate launch` (DDP over gloo, 2 processes) runs each
LoRA script as the reference; the same scripts run with ElixirTrainer / ElixirAccelerator
named explicitly, and unmodified under `hf-elixir launch`. Every adapter folder is loaded
the way PEFT users load it, `PeftModel.from_pretrained(base, folder)`, onto a base read from
disk, and must give the trained model's logits.

The runs that name hf_elixir pin a plan with 2 rCache blocks, so that frozen chunks are
released and gathered again during each pass; the launched one plans itself.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from equivalence import assert_state_close
from harness import free_port
from hf_elixir.integrations.launch import accelerate_view, default_config, read_config, write_config
from hf_elixir.integrations.plugin import ElixirPlugin
from integration_helpers import SCRIPTS, accelerate_launch, check, elixir_launch, run, worker_env
from tiny_models import make_model

pytestmark = pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False:UserWarning")

W = 2
TRAINER = "peft_trainer_run.py"
LOOP = "peft_accelerate_loop.py"
TARGETS = {"gpt2": "c_attn", "llama": "q_proj,v_proj,gate_proj,down_proj"}
# 32 samples, 2 per device, 2 processes, accumulation 2: 4 optimizer steps; evaluation and a
# checkpoint every 2
TRAIN_ARGS = ["--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4",
              "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5", "--learning_rate", "3e-2",
              "--adam_epsilon", "1e-6", "--weight_decay", "0.1", "--warmup_steps", "1",
              "--num_train_epochs", "1", "--eval_strategy", "steps", "--eval_steps", "2",
              "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
              "--report_to", "none", "--seed", "0", "--optim", "adamw_torch", "--disable_tqdm", "true"]
PINNED = json.dumps({"chunk_size_mb": 4096 * 4 / 2**20, "rcache_blocks": 2})
PROBE = torch.arange(16).reshape(1, 16) % 96
TIED = {"lm_head.weight": "transformer.wte.weight"}  # GPT-2's head is its embedding, saved once


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Launcher configs (the elixir one plans automatically) and the base models on disk."""
    d = tmp_path_factory.mktemp("peft")
    write_config(d / "elixir.yaml", default_config(W, use_gpu=False), ElixirPlugin(plan="auto"))
    plain, _ = accelerate_view(read_config(d / "elixir.yaml"), cuda=False)
    (d / "plain.yaml").write_text(yaml.safe_dump(plain))
    for arch in TARGETS:
        make_model(arch).save_pretrained(d / f"base_{arch}")
    return d


def trainer_args(work: Path, arch: str, output: Path, result: Path, accumulation: int = 2) -> list[str]:
    args = ["--base", str(work / f"base_{arch}"), "--target_modules", TARGETS[arch],
            "--output_dir", str(output), "--result", str(result), *TRAIN_ARGS]
    args[args.index("--gradient_accumulation_steps") + 1] = str(accumulation)
    return args


@pytest.fixture(scope="module")
def trainer_runs(work) -> dict:
    """Per architecture, the DDP reference and an ElixirTrainer run of the same script: for
    GPT-2 the unmodified script under `hf-elixir launch` (the planner's own plan), for the
    Llama-style model ElixirTrainer named in the script (``--elixir``) with the pinned plan."""
    out: dict = {}

    def args(arch: str, name: str) -> list[str]:
        return trainer_args(work, arch, work / name, work / f"{name}.pt")

    for arch in TARGETS:
        accelerate_launch(work / "plain.yaml", free_port(), TRAINER, *args(arch, f"plain_{arch}"), cwd=work)
    launched = elixir_launch(work / "elixir.yaml", free_port(), TRAINER, *args("gpt2", "elixir_gpt2"), cwd=work)
    named = accelerate_launch(work / "plain.yaml", free_port(), TRAINER, *args("llama", "elixir_llama"),
                              "--elixir", "--elixir_config", PINNED, cwd=work)
    for arch, proc in (("gpt2", launched), ("llama", named)):
        out[arch] = (torch.load(work / f"plain_{arch}.pt"), torch.load(work / f"elixir_{arch}.pt"), proc)
    return out


def base_key(peft_key: str) -> str:
    """The base model's name of a frozen PEFT parameter."""
    return peft_key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def base_weights(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_same_lora_training(plain: dict, elixir: dict, base: dict[str, torch.Tensor], label: str) -> None:
    """Losses within rel 1e-5, adapters within the architecture sweep's criterion, and every
    frozen tensor exactly the base's."""
    assert len(elixir["losses"]) == len(plain["losses"]) == 4
    assert elixir["losses"] == pytest.approx(plain["losses"], rel=1e-5), label
    assert elixir["evals"] == pytest.approx(plain["evals"], rel=1e-5), label
    adapters = {k for k in plain["state"] if "lora_" in k}
    assert adapters and all(plain["state"][k].abs().max() > 0 for k in adapters)
    b_weights = [k for k in adapters if "lora_B" in k]  # PEFT starts B at zero: it must have trained
    assert all(elixir["state"][k].abs().max() > 1e-3 for k in b_weights), label
    assert_state_close({k: plain["state"][k] for k in adapters}, {k: elixir["state"][k] for k in adapters},
                       label=label)
    frozen = set(elixir["state"]) - adapters
    assert set(elixir["state"]) == set(plain["state"])
    for k in frozen:
        name = base_key(k) if base_key(k) in base else TIED[base_key(k)]
        assert torch.equal(elixir["state"][k], base[name]), f"{label}: frozen {k} changed"


def peft_logits(base_folder: Path, adapter: str | Path) -> torch.Tensor:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder), adapter).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits.float()


def assert_adapter_folder(folder: Path) -> None:
    """What PEFT users expect, and no copy of the base next to it."""
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    assert not list(folder.glob("model*.safetensors")) and not list(folder.glob("pytorch_model*"))
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        assert all("lora_" in k for k in f.keys())


@pytest.mark.parametrize("arch", list(TARGETS))
def test_elixir_trainer_lora_matches_ddp(work, trainer_runs, arch) -> None:
    """Acceptance 1 (ElixirTrainer): losses, adapters, frozen weights bit-identical, and each
    rank holds only its shard of the frozen bytes."""
    plain, elixir, proc = trainer_runs[arch]
    assert not plain["is_elixir"] and plain["trainer"] == "Trainer" and plain["world"] == W
    assert elixir["is_elixir"] and elixir["trainer"] == "ElixirTrainer" and elixir["world"] == W
    assert proc.stdout.count("hf_elixir is active on 2 process(es)") == 1
    assert_same_lora_training(plain, elixir, base_weights(work / f"base_{arch}"), arch)
    assert elixir["n_frozen_chunks"] >= 1
    peak = elixir["memory"]["peak"]["frozen_shards"]
    assert elixir["frozen_bytes"] / W <= peak <= elixir["frozen_bytes"] / W + elixir["frozen_padding"] / W


def test_pinned_plan_gathers_frozen_chunks_again_within_the_rcache(trainer_runs) -> None:
    """With 2 rCache blocks for 10+ chunks, frozen chunks were released and gathered again in
    every pass, and never more than the rCache was resident: the match above is not a run
    that kept the base gathered."""
    _, elixir, proc = trainer_runs["llama"]
    assert elixir["n_frozen_chunks"] >= 4
    memory = elixir["memory"]
    assert memory["rcache_blocks"] == 2
    assert memory["peak"]["rcache"] <= 2 * memory["rcache_block_bytes"] < elixir["frozen_bytes"]
    assert memory["cache_stats"]["evictions"] > 0, memory["cache_stats"]
    # a pinned plan predicts no throughput; the measured one comes from the batch shape
    measured = re.search(r"hf_elixir throughput: ([\d,]+) tokens/s measured", proc.stdout)
    assert measured and int(measured.group(1).replace(",", "")) > 0, proc.stdout[-2000:]
    # below it, rank 0's step breakdown (a pinned plan: no predicted column)
    breakdown = proc.stdout[measured.end():]
    assert breakdown.count("step time by phase (mean of") == 1, proc.stdout[-2000:]
    rows = {line.split()[0]: line.split() for line in breakdown.splitlines()[2:] if line.startswith("  ")}
    assert float(rows["forward_backward"][1]) > 0 and rows["forward_backward"][2] == "-"
    assert float(rows["step"][1]) >= float(rows["forward_backward"][1])


@pytest.mark.parametrize("arch", list(TARGETS))
def test_elixir_trainer_saves_an_adapter_peft_loads(work, trainer_runs, arch) -> None:
    _, elixir, _ = trainer_runs[arch]
    final = Path(elixir["final"])
    assert_adapter_folder(final)
    torch.testing.assert_close(peft_logits(work / f"base_{arch}", final), elixir["logits"], rtol=1e-5, atol=1e-5)


def test_trainer_checkpoints_hold_adapter_and_sharded_state_only(work, trainer_runs) -> None:
    """save_steps: the adapter folder (what PEFT's Trainer writes) and elixir_state/, and no
    second copy of the frozen base anywhere in it: every tensor stored is an adapter's (its
    weights, or their optimizer state)."""
    for arch in TARGETS:
        ckpt = work / f"elixir_{arch}" / "checkpoint-2"
        assert (ckpt / "elixir_state" / "elixir_index.json").is_file()
        assert (ckpt / "scheduler.pt").is_file() and (ckpt / "trainer_state.json").is_file()
        assert_adapter_folder(ckpt)
        files = list(ckpt.rglob("*.safetensors"))
        assert any("optimizer" in f.name for f in files)
        assert not list(ckpt.rglob("pytorch_model*")) and not (ckpt / "optimizer.pt").exists()
        for path in files:
            with safe_open(str(path), "pt") as f:
                frozen = [k for k in f.keys() if "lora_" not in k]
            assert not frozen, f"{arch}: {path.relative_to(ckpt)} stores frozen tensors {frozen[:3]}"


def test_stock_peft_trainer_script_under_hf_elixir_launch(work, trainer_runs) -> None:
    """Acceptance 2: the script imports only transformers and peft; under `hf-elixir launch`
    its `Trainer` is ElixirTrainer, the planner chose a plan with frozen chunks, and training
    and the saved adapter match plain `accelerate launch`."""
    plain, launched, proc = trainer_runs["gpt2"]
    assert launched["trainer"] == "ElixirTrainer" and launched["accelerator"] == "ElixirAccelerator"
    assert launched["is_elixir"] and launched["world"] == W
    assert proc.stdout.count("hf_elixir is active on 2 process(es)") == 1
    assert "frozen weights:" in proc.stdout  # the searched plan's summary accounts for the frozen base
    assert launched["n_frozen_chunks"] >= 1
    assert_same_lora_training(plain, launched, base_weights(work / "base_gpt2"), "launched")
    final = Path(launched["final"])
    assert_adapter_folder(final)
    torch.testing.assert_close(peft_logits(work / "base_gpt2", final), launched["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(launched["logits"], plain["logits"], rtol=1e-5, atol=1e-5)


def test_launched_lora_checkpoint_resumes_at_world_size_1(work, trainer_runs, tmp_path) -> None:
    """The Trainer resumes a LoRA checkpoint written by 2 processes in one (accumulation 4
    for the same global batch) and ends with the uninterrupted run's adapter."""
    _, launched, _ = trainer_runs["gpt2"]
    out = tmp_path / "resumed"
    shutil.copytree(work / "elixir_gpt2" / "checkpoint-2", out / "checkpoint-2")
    args = trainer_args(work, "gpt2", out, tmp_path / "r.pt", accumulation=4)
    check(run([sys.executable, "-m", "hf_elixir.integrations.bootstrap", str(SCRIPTS / TRAINER), *args,
               "--resume_from_checkpoint", str(out / "checkpoint-2")], tmp_path,
              worker_env(ACCELERATE_USE_ELIXIR="true")))
    resumed = torch.load(tmp_path / "r.pt")
    assert resumed["is_elixir"] and resumed["world"] == 1 and resumed["global_step"] == 4
    assert launched["steps_run"] == [1, 2, 3, 4] and resumed["steps_run"] == [3, 4]  # it did resume
    assert resumed["losses"] == pytest.approx(launched["losses"], rel=1e-5)
    adapters = {k for k in launched["state"] if "lora_" in k}
    assert_state_close({k: launched["state"][k] for k in adapters}, {k: resumed["state"][k] for k in adapters},
                       label="resumed")
    for k in set(launched["state"]) - adapters:
        assert torch.equal(resumed["state"][k], launched["state"][k])


# ---------------------------------------------------------------------- a custom Accelerate loop
@pytest.fixture(scope="module")
def loop_runs(work) -> tuple[dict, dict, Path]:
    base = ["--base", str(work / "base_gpt2")]
    accelerate_launch(work / "plain.yaml", free_port(), LOOP, *base, "--out_dir", str(work / "loop_plain"), cwd=work)
    proc = accelerate_launch(work / "plain.yaml", free_port(), LOOP, *base, "--elixir",
                             "--out_dir", str(work / "loop_elixir"),
                             "--save_state", str(work / "loop_elixir" / "state"), cwd=work)
    assert "hf_elixir is active on 2 process(es)" in proc.stdout
    return (torch.load(work / "loop_plain" / "result.pt"), torch.load(work / "loop_elixir" / "result.pt"),
            work / "loop_elixir")


def test_elixir_accelerator_prepares_a_peft_model_like_ddp(loop_runs) -> None:
    plain, elixir, _ = loop_runs
    assert plain["type"] == "Accelerator" and elixir["type"] == "ElixirAccelerator" and elixir["is_elixir"]
    assert elixir["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert elixir["norms"] == pytest.approx(plain["norms"], rel=1e-4)
    assert_state_close(plain["state"], elixir["state"], label="loop")
    torch.testing.assert_close(elixir["logits"], plain["logits"], rtol=1e-5, atol=1e-5)


def test_accelerate_save_paths_write_adapters_peft_loads(work, loop_runs) -> None:
    """accelerator.save_model and PEFT's own unwrap_model(...).save_pretrained(state_dict=
    accelerator.get_state_dict(model)) both give the adapter; save_state holds the sharded
    state and no model weights file; save_pretrained without a state_dict fails clearly."""
    _, elixir, out = loop_runs
    for folder in ("save_model", "unwrapped"):
        assert_adapter_folder(out / folder)
        torch.testing.assert_close(peft_logits(work / "base_gpt2", out / folder), elixir["logits"],
                                   rtol=1e-5, atol=1e-5)
    state = out / "state"
    assert (state / "elixir_state" / "elixir_index.json").is_file() and (state / "scheduler.bin").is_file()
    assert not list(state.glob("model*.safetensors"))
    message = elixir["without_state_dict"]
    assert message.startswith("ReleasedParameterError") and "get_state_dict" in message
    assert not (out / "no_state_dict" / "adapter_model.safetensors").exists()
