"""QLoRA through TRL's SFTTrainer under `hf-elixir launch` (issue 37, acceptance 3).

A stock QLoRA script (``scripts/trl_qlora_sft.py``: a base loaded 4-bit from a folder with a
``BitsAndBytesConfig``, ``prepare_model_for_kbit_training``, a ``LoraConfig`` given to
``SFTTrainer`` as ``peft_config``, ``train()``, ``save_model()``) runs unchanged under
`hf-elixir launch` (2 processes) and under plain `accelerate launch` (DDP, 2 processes).
The packed 4-bit weights go into frozen chunks byte for byte; the pinned plan has fewer
rCache blocks than chunks, so they are released and gathered again every pass.

TRL casts the adapters of a quantised base to bf16. DDP then trains them in bf16 (bf16
gradients, AdamW on bf16 weights); hf_elixir holds every weight in its compute dtype
(float32) with a float32 master, trains them in float32 and saves them back in bf16. So the
stock pair agrees to the digits the Trainer prints (4 significant), and the same script under
DDP with ``--adapter_dtype float32`` (the adapters put back in float32: the arithmetic
hf_elixir does) is the exact reference: logged values within 1e-5, the trained float32
adapters within the 2e-6 of test_trl.py. A fourth run resumes the launched run's checkpoint
(its 4-bit base recorded by the digest of its bytes) at world size 1; in this process the
checkpoint loads onto a fresh 4-bit base held in float32 or bf16 and refuses one whose packed
bytes differ.

The launched runs pin their plan (as test_trl.py's do); planning such a model
automatically, with the forward TRL patched, runs no real module
(``test_auto_plan_of_an_sft_trainer_model``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig

import bitsandbytes  # noqa: F401  (in the test extra: a missing one fails here, never skips)
from harness import free_port
from hf_elixir.checkpoint import CheckpointError, load
from hf_elixir.checkpoint.frozen import tensor_digest
from hf_elixir.integrations.launch import accelerate_view, default_config, read_config, write_config
from hf_elixir.integrations.plugin import ElixirPlugin
from integration_helpers import SCRIPTS, accelerate_launch, check, elixir_launch, run, worker_env

W = 2
SCRIPT = "trl_qlora_sft.py"
# the plan test_trl.py pins: chunks of ~4096 fp32 elements (31 for this model, 14 of them
# holding packed 4-bit weights) and 3 rCache blocks, so frozen chunks are evicted and gathered
# again within every pass
ELIXIR_OPTIONS = dict(chunk_size_mb=0.016, rcache_blocks=3)
# SFTConfig defaults (gradient checkpointing on, linear schedule, clipping at 1.0, ...) except
# fp32 on a CPU, 3 logged steps of 4 sequences, a checkpoint at step 2 (and, at the end, 3)
SFT_ARGS = ["--bf16", "false", "--max_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "2",
            "--learning_rate", "1e-3", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true",
            "--save_strategy", "steps", "--save_steps", "2"]
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy")
WEIGHT_TOL = 2e-6  # test_trl.py's
N_QUANTISED = 14   # 2 layers x 7 projections, all 4-bit (the LM head and embeddings are not)


def _script_module():
    """The script's own loader, so the test reloads adapters onto the base the script uses."""
    spec = importlib.util.spec_from_file_location("trl_qlora_sft_script", SCRIPTS / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Launcher configs and the base on disk (float32; the script quantises it on load)."""
    d = tmp_path_factory.mktemp("qlora_trl")
    write_config(d / "elixir.yaml", default_config(W, use_gpu=False), ElixirPlugin(**ELIXIR_OPTIONS))
    plain, _ = accelerate_view(read_config(d / "elixir.yaml"), cuda=False)
    (d / "plain.yaml").write_text(yaml.safe_dump(plain))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(d / "base")
    return d


@pytest.fixture(scope="module")
def runs(work) -> dict:
    """The stock script under plain DDP and under hf_elixir with the same arguments, and
    under plain DDP with the adapters kept in float32."""
    base = ["--base", str(work / "base"), *SFT_ARGS]

    def out(name: str) -> list[str]:
        return ["--output_dir", str(work / name), "--result", str(work / f"{name}.pt")]

    accelerate_launch(work / "plain.yaml", free_port(), SCRIPT, *out("plain"), *base, cwd=work)
    proc = elixir_launch(work / "elixir.yaml", free_port(), SCRIPT, *out("elixir"), *base, cwd=work)
    accelerate_launch(work / "plain.yaml", free_port(), SCRIPT, *out("plain_fp32"), *base,
                      "--adapter_dtype", "float32", cwd=work)
    read = lambda name: torch.load(work / f"{name}.pt", weights_only=False)  # noqa: E731
    return {"plain": read("plain"), "elixir": read("elixir"), "plain_fp32": read("plain_fp32"), "proc": proc}


def steps(run: dict) -> list[dict]:
    return [h for h in run["log_history"] if "loss" in h]


def adapters(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "lora_" in k}


def saved_masters(state_dir: Path) -> dict[str, torch.Tensor]:
    """The float32 master values of every trainable parameter in an ``elixir_state/`` folder,
    put together from the ranks' slices (docs/checkpoints.md: slice [begin, end) of the
    flattened parameter lies in rank r's model file under the parameter's name)."""
    index = json.loads((state_dir / "elixir_index.json").read_text())
    out = {}
    for entry in index["params"]:
        flat = torch.full((entry["numel"],), float("nan"))
        for rank, begin, end in entry["slices"]:
            with safe_open(str(state_dir / index["rank_files"][rank]["model"]), "pt") as f:
                flat[begin:end] = f.get_tensor(entry["name"])
        out[entry["name"]] = flat.view(entry["shape"])
    return out


def test_runs_are_what_they_claim(runs) -> None:
    """The launched run is SFTTrainer on ElixirTrainer over an ElixirModule whose packed
    4-bit weights lie in frozen chunks, with fewer rCache blocks than chunks; the reference
    is plain DDP. Both kept the 4-bit layers, the checkpointing and input gradients of
    prepare_model_for_kbit_training, and TRL's bf16 adapters (held in float32 by hf_elixir)."""
    plain, elixir, fp32 = runs["plain"], runs["elixir"], runs["plain_fp32"]
    assert runs["proc"].stdout.count("hf_elixir is active on 2 process(es)") == 1
    assert elixir["is_elixir"] and elixir["wrapped"] == "ElixirModule" and elixir["world"] == W
    assert elixir["trainer_mro"][0] == "SFTTrainer" and "ElixirTrainer" in elixir["trainer_mro"]
    assert elixir["packed_chunks"] >= N_QUANTISED // 2
    assert elixir["rcache_blocks"] == ELIXIR_OPTIONS["rcache_blocks"] < elixir["chunks"]
    assert elixir["evictions"] > 0  # chunks were released and gathered again
    for ddp in (plain, fp32):
        assert not ddp["is_elixir"] and ddp["wrapped"] == "DistributedDataParallel" and ddp["world"] == W
        assert "ElixirTrainer" not in ddp["trainer_mro"] and ddp["chunks"] is None
    for result in (plain, elixir, fp32):
        assert result["global_step"] == 3 and result["steps_run"] == [1, 2, 3]
        assert result["quantised_layers"] == N_QUANTISED
        assert result["checkpointing"] and result["input_grads"]
    assert plain["adapter_dtypes"] == ["torch.bfloat16"]  # TRL's cast for a quantised base
    assert elixir["adapter_dtypes"] == fp32["adapter_dtypes"] == ["torch.float32"]
    # what get_state_dict (and save_model) give back: the model's own dtype, bf16
    assert {v.dtype for v in adapters(elixir["state"]).values()} == {torch.bfloat16}


def test_stock_script_matches_ddp_to_the_logged_digits(runs) -> None:
    """Acceptance 3: the same script, the same arguments; the loss, entropy and token accuracy
    agree to the 4 significant digits the Trainer prints (and within 2e-5), the grad norm
    within 1% (DDP's is a bf16 norm of bf16 gradients)."""
    plain, elixir = runs["plain"], runs["elixir"]
    assert len(steps(plain)) == len(steps(elixir)) == 3
    for p, e in zip(steps(plain), steps(elixir)):
        assert p["step"] == e["step"]
        for key in ("loss", "entropy", "mean_token_accuracy"):
            printed_unit = 10.0 ** (math.floor(math.log10(abs(p[key]))) - 3)  # the 4th significant digit
            assert abs(e[key] - p[key]) < printed_unit / 2, (p["step"], key, p[key], e[key])
            assert e[key] == pytest.approx(p[key], rel=2e-5), (p["step"], key, p[key], e[key])
        # DDP's: the bf16 norm of bf16 gradients from a bf16 LoRA forward
        assert e["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-2), (p["step"], p["grad_norm"], e["grad_norm"])
    assert steps(plain)[0]["grad_norm"] > 0


def test_launched_run_equals_ddp_training_the_adapters_in_float32(work, runs) -> None:
    """The exact reference: every logged value within 1e-5, and the launched run's trained
    float32 adapters (its last checkpoint's masters) within 2e-6 of DDP's, after every one
    of them moved far more than that (so each layer got its gradients, through the
    checkpointed layers and the packed base gathered again in backward)."""
    elixir, fp32 = runs["elixir"], runs["plain_fp32"]
    for p, e in zip(steps(fp32), steps(elixir), strict=True):
        for key in LOGGED:
            assert e[key] == pytest.approx(p[key], rel=1e-5, abs=1e-7), (p["step"], key, p[key], e[key])
    masters = saved_masters(work / "elixir" / "checkpoint-3" / "elixir_state")
    reference = adapters(fp32["state"])
    assert set(masters) == set(reference) and len(reference) == 2 * N_QUANTISED
    diff = max((masters[k] - reference[k]).abs().max().item() for k in reference)
    assert diff < WEIGHT_TOL, diff
    # lora_B starts at zero: every one of them trained
    assert min(masters[k].abs().max().item() for k in masters if "lora_B" in k) > 100 * WEIGHT_TOL


def test_saved_adapter_reloads_on_a_fresh_4bit_base(work, runs) -> None:
    """save_model wrote a PEFT adapter folder (no base weights in it) that
    PeftModel.from_pretrained loads onto a 4-bit base loaded afresh; the loaded adapters are
    what the run trained (its float32 masters, saved in the model's bf16), and they change
    the base's output."""
    elixir = runs["elixir"]
    final = Path(elixir["final"])
    assert final == work / "elixir" / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not list(final.glob("model*.safetensors")) and not list(final.glob("pytorch_model*"))
    with safe_open(str(final / "adapter_model.safetensors"), "pt") as f:
        assert all("lora_" in k for k in f.keys())

    script = _script_module()
    model = PeftModel.from_pretrained(script.load_base(work / "base", "uint8"), final).eval()
    assert sum(script.is_4bit_layer(m) for m in model.modules()) == N_QUANTISED
    loaded = adapters(model.state_dict())
    trained = adapters(elixir["state"])
    masters = saved_masters(work / "elixir" / "checkpoint-3" / "elixir_state")
    assert set(loaded) == set(trained) == set(masters)
    for k, v in loaded.items():
        assert torch.equal(v.float(), trained[k].float()), k
        assert torch.equal(trained[k], masters[k].to(torch.bfloat16)), k
    probe = torch.arange(3, 19).reshape(1, 16)
    with torch.no_grad():
        tuned = model(input_ids=probe).logits
        with model.disable_adapter():
            plain = model(input_ids=probe).logits
    assert (tuned - plain).abs().max() > 1e-4


def test_checkpoint_records_the_4bit_base_by_digest_and_stores_none_of_it(work, runs) -> None:
    """checkpoint-2 holds the adapter folder, the Trainer's files and elixir_state/, whose
    index records every frozen weight (the packed 4-bit ones with their own dtype and
    shape) by digest and whose files store no frozen weight."""
    ckpt = work / "elixir" / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "trainer_state.json").is_file()
    state_dir = ckpt / "elixir_state"
    index = json.loads((state_dir / "elixir_index.json").read_text())
    assert index["format_version"] == 2 and index["world_size"] == W

    load_base = _script_module().load_base
    base = load_base(work / "base", "uint8")
    packed = {n: p for n, p in base.named_parameters() if type(p).__name__ == "Params4bit"}
    assert len(packed) == N_QUANTISED
    records = {r["name"]: r for r in index["frozen"]["params"]}
    as_peft = {n.replace(".weight", ".base_layer.weight"): p for n, p in packed.items()}
    for name, p in as_peft.items():
        record = records["base_model.model." + name]
        assert record["dtype"] == "uint8" and tuple(record["shape"]) == tuple(p.shape)
        # the digest of its bytes, whatever dtype the chunks held them in (checkpoint/frozen.py)
        assert set(record["digest"]) == {"float32", "bfloat16", "float16"}
        assert set(record["digest"].values()) == {tensor_digest(p.data.view(torch.uint8))}, name
    frozen = {r["name"] for r in index["frozen"]["params"]}
    assert len(frozen) == len(list(base.parameters()))
    for path in state_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            stored = set(f.keys())
        assert not stored & frozen, f"{path.name} stores frozen weights {sorted(stored & frozen)[:3]}"


def test_trainer_resumes_the_4bit_checkpoint_at_world_size_1(work, runs, tmp_path) -> None:
    """The Trainer resumes checkpoint-2 of the 2-process run in one process (4 sequences a
    step, the same global batch) onto a 4-bit base loaded afresh, whose packed weights the
    load checks against the digests: it runs step 3 only and ends where the uninterrupted
    run ended."""
    out = tmp_path / "resumed"
    shutil.copytree(work / "elixir" / "checkpoint-2", out / "checkpoint-2")
    args = ["--base", str(work / "base"), *SFT_ARGS, "--output_dir", str(out), "--result", str(tmp_path / "r.pt"),
            "--resume_from_checkpoint", str(out / "checkpoint-2")]
    args[args.index("--per_device_train_batch_size") + 1] = "4"
    # the launched run's pinned plan (plan: auto fails for SFTTrainer: test_auto_plan_of_an_sft_trainer_model)
    pinned = {f"ELIXIR_{k.upper()}": str(v) for k, v in ELIXIR_OPTIONS.items()}
    check(run([sys.executable, "-m", "hf_elixir.integrations.bootstrap", str(SCRIPTS / SCRIPT), *args], tmp_path,
              worker_env(ACCELERATE_USE_ELIXIR="true", **pinned)))
    resumed = torch.load(tmp_path / "r.pt", weights_only=False)
    assert resumed["is_elixir"] and resumed["world"] == 1 and resumed["packed_chunks"] >= 1
    assert resumed["global_step"] == 3 and resumed["steps_run"] == [3]
    launched = runs["elixir"]
    logged = steps(resumed)  # steps 1 and 2 come from the checkpoint's trainer_state.json
    assert [h["step"] for h in logged] == [1, 2, 3]
    assert logged[2]["loss"] == pytest.approx(steps(launched)[2]["loss"], rel=1e-5)
    assert logged[2]["grad_norm"] == pytest.approx(steps(launched)[2]["grad_norm"], rel=1e-5)
    ended = saved_masters(out / "checkpoint-3" / "elixir_state")
    uninterrupted = saved_masters(work / "elixir" / "checkpoint-3" / "elixir_state")
    assert set(ended) == set(uninterrupted)
    diff = max((ended[k] - uninterrupted[k]).abs().max().item() for k in ended)
    assert diff < WEIGHT_TOL, diff


# ---------------------------------------------------------------------- the checkpoint, in process
def qlora_model(base: Path):
    """The script's model before training: the 4-bit base, prepared, with its LoRA adapters
    in bf16 as SFTTrainer leaves them."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    script = _script_module()
    model = prepare_model_for_kbit_training(script.load_base(base, "uint8"), use_gradient_checkpointing=True)
    model = get_peft_model(model, LoraConfig(**script.LORA))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_loads_on_a_fresh_4bit_base_in_either_compute_dtype(work, runs, dtype) -> None:
    """checkpoint-2, saved by 2 float32 ranks, loads into one rank holding the model in
    float32 or bf16: the packed bytes' digests are the same in both (a bf16 load used to be
    refused as 'another base'), and the adapters are the checkpoint's."""
    import hf_elixir as hfe

    model = qlora_model(work / "base")
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, compute_dtype=dtype), device="cpu")
    try:
        state_dir = work / "elixir" / "checkpoint-2" / "elixir_state"
        assert load(emodel, None, state_dir)["resharded"]
        held = adapters(emodel.state_dict())
    finally:
        emodel.close()
    saved = saved_masters(state_dir)
    assert set(held) == set(saved)
    for k, v in held.items():
        assert torch.equal(v, saved[k].to(torch.bfloat16)), k  # the model's own dtype, bf16


def test_checkpoint_refuses_a_4bit_base_with_one_byte_changed(work, runs) -> None:
    import hf_elixir as hfe

    model = qlora_model(work / "base")
    name = "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight"
    weight = model.get_parameter(name)
    weight.data.view(torch.uint8).view(-1)[77] ^= 0x10  # one 4-bit code of one block
    emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1), device="cpu")
    try:
        with pytest.raises(CheckpointError, match="not those the checkpoint was trained on") as refused:
            load(emodel, None, work / "elixir" / "checkpoint-2" / "elixir_state")
    finally:
        emodel.close()
    assert f"{name!r} has digest" in str(refused.value) and "1 of 21 frozen tensors differ" in str(refused.value)


def test_auto_plan_of_an_sft_trainer_model(work) -> None:
    """What `hf-elixir launch` does with its default config (plan: auto) for any SFTTrainer
    script: the planner profiles the model on a meta copy. SFTTrainer first adds TRL's fused
    LM head (``model.forward`` replaced by a wrapper closing over the original bound
    forward); a copy that kept that closure ran the real model on meta inputs and failed at
    the loss (``labels.to(logits.device)``: 'Cannot copy out of meta tensor'), so the meta
    copy rebinds such a forward to itself (``trace.rebind_patched_forwards``)."""
    import hf_elixir as hfe
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from trl.trainer.utils import add_fused_lm_head

    script = _script_module()
    model = prepare_model_for_kbit_training(script.load_base(work / "base", "uint8"), use_gradient_checkpointing=True)
    add_fused_lm_head(model)  # what SFTTrainer does, before it makes the PEFT model
    model = get_peft_model(model, LoraConfig(**script.LORA))
    real = model.get_submodule("base_model.model.model.layers.0")
    ran = []
    real.register_forward_pre_hook(lambda module, args: ran.append(module is real))  # copied hooks see the copy
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = hfe.plan(model, {"input_ids": ids, "labels": ids}, world_size=W, hardware="cpu", efficiency="calibrated")
    assert plan.chunks and not any(ran), "planning ran the real model"
