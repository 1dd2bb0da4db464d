"""Checkpoints of partly frozen models (issue 25, acceptance 3): the frozen base is recorded
by name, shape and digest, never stored; a resume takes it from the model it loads into and
refuses another base before changing anything.

One 2-rank run (module fixture) trains a LoRA GPT-2 2 steps, saves, trains 3 more (the
uninterrupted run) and checks that both ranks refuse a checkpoint onto another base. The
tests resume that checkpoint at world size 1 under another plan, measure its files, and try
other bases; the frozen-embeddings tests (no PEFT) run in this process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import hf_elixir as hfe
from equivalence import assert_state_close
from harness import run_distributed
from hf_elixir import checkpoint as ck
from hf_elixir.checkpoint import frozen as frz
from hf_elixir.checkpoint.index import INDEX_NAME, PLAIN_FORMAT_VERSION, UNTRACKED_NAME
from hf_elixir.checkpoint.io import SafetensorsReader, file_sha256, write_safetensors
from loops import elixir_steps
from tiny_models import make_batch

pytestmark = pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False:UserWarning")

BATCH, SEQ = 8, 16
SAVE_PLAN = dict(chunk_size=4096)
# another world size, chunking and placement: trainable state reshards, frozen shards move
RESUME_PLAN = dict(chunk_size=8192, offload_fraction=0.5, offload_params=True, offload_frozen=0.5)
BEFORE, AFTER = 2, 3


def gpt2(seed: int = 0, **overrides) -> torch.nn.Module:
    """tests/tiny_models.py's GPT-2, optionally with other config values (another shape)."""
    import transformers as tf

    from tiny_models import _configs

    config = _configs()["gpt2"]()
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.config.use_cache = False
    return model.float()


def lora(base_seed: int = 0, adapter_seed: int = 0, **overrides) -> torch.nn.Module:
    """LoRA r=4 on c_attn over a frozen GPT-2 base; adapters start non-zero (and differ with
    ``adapter_seed``) so a resume that failed to load them would show."""
    from peft import LoraConfig, get_peft_model

    base = gpt2(base_seed, **overrides)
    torch.manual_seed(1000 + adapter_seed)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))


def frozen_embeddings(seed: int = 0, wpe_scale: float = 1.0, freeze_wpe: bool = True) -> torch.nn.Module:
    """Non-PEFT partial freezing: the (tied) token embedding and the position embedding."""
    model = gpt2(seed)
    model.transformer.wte.weight.requires_grad_(False)
    model.transformer.wpe.weight.requires_grad_(not freeze_wpe)
    with torch.no_grad():
        model.transformer.wpe.weight.mul_(wpe_scale)
    return model


class Trained:
    """One rank's wrapped model, optimizer (over every parameter, frozen ones included, as
    many scripts build it) and warm-up schedule; each step trains on the rank's rows."""

    def __init__(self, model: torch.nn.Module, rank: int, world_size: int, plan_kwargs: dict) -> None:
        self.rank, self.world_size = rank, world_size
        self.model = model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        self.emodel = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, **plan_kwargs))
        self.eopt = hfe.ElixirOptimizer(self.emodel, opt)
        self.ids = make_batch(BATCH, SEQ)

    def steps(self, n: int) -> dict:
        """``n`` steps on this rank's rows: their losses and the lr each one used."""
        per = BATCH // self.world_size
        lrs: list[float] = []
        losses = elixir_steps(self.emodel, self.eopt, [self.ids[self.rank * per : (self.rank + 1) * per]] * n,
                              clip=1.0, scheduler=self.sched,
                              each_step=lambda _: lrs.append(self.eopt.param_groups[0]["lr"]))
        return {"losses": losses, "lrs": lrs}

    def snapshot(self) -> dict:
        """Everything a load could change: shards, optimizer state and counters, groups, and
        the full state_dict (collective)."""
        return {
            "master": [c.master.clone() for c in self.emodel.chunks],
            "shard": [c.shard.clone() for c in self.emodel.chunks],
            "opt": [{k: v.clone() for k, v in s.items()} for s in self.eopt.flat_state],
            "steps": {k: float(v) for k, v in self.eopt.steps.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.eopt.param_groups],
            "sched": self.sched.state_dict(),
            "state": self.emodel.state_dict(),
        }


def assert_unchanged(a: dict, b: dict) -> None:
    for x, y in zip(a["master"] + a["shard"], b["master"] + b["shard"]):
        assert torch.equal(x, y), "model shards changed"
    assert [list(s) for s in a["opt"]] == [list(s) for s in b["opt"]]
    for sa, sb in zip(a["opt"], b["opt"]):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"optimizer state {k} changed"
    assert a["steps"] == b["steps"] and a["groups"] == b["groups"] and a["sched"] == b["sched"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), f"{k} changed"


def refusal(run: Trained, directory, *needles: str) -> str:
    """Load must raise naming ``needles`` and leave ``run`` exactly as it was."""
    before = run.snapshot()
    with pytest.raises(ck.CheckpointError) as exc:
        ck.load(run.emodel, run.eopt, directory, scheduler=run.sched)
    assert_unchanged(before, run.snapshot())
    for needle in needles:
        assert needle in str(exc.value), str(exc.value)
    return str(exc.value)


def adapters(state: dict) -> dict:
    return {k: v for k, v in state.items() if ".lora_" in k}


def frozen_keys(model: torch.nn.Module) -> set[str]:
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    return {k for k, v in model.state_dict(keep_vars=True).items() if id(v) in frozen}


# ---------------------------------------------------------------------- the 2-rank LoRA run
def _lora_two_ranks(rank: int, world_size: int, ckdir: str) -> dict:
    run = Trained(lora(), rank, world_size, SAVE_PLAN)
    run.steps(BEFORE)
    ck.save(run.emodel, run.eopt, ckdir, scheduler=run.sched)
    uninterrupted = run.steps(AFTER)
    final = run.emodel.state_dict()

    # another base at the same world size: both ranks refuse and change nothing
    other = Trained(lora(base_seed=1), rank, world_size, SAVE_PLAN)
    other.steps(1)
    error = refusal(other, ckdir, "digest")
    return {"uninterrupted": uninterrupted, "final": final if rank == 0 else None, "error": error}


@pytest.fixture(scope="module")
def lora2(tmp_path_factory):
    ckdir = str(tmp_path_factory.mktemp("lora2") / "ckpt")
    ranks = run_distributed(_lora_two_ranks, 2, ckdir)
    return {"dir": Path(ckdir), "ranks": ranks, **ranks[0]}


def test_lora_checkpoint_at_world_size_2_resumes_at_world_size_1(lora2) -> None:
    fresh = Trained(lora(adapter_seed=7), 0, 1, RESUME_PLAN)
    key = next(iter(adapters(lora2["final"])))
    assert not torch.equal(fresh.emodel.state_dict()[key], lora2["final"][key])
    info = ck.load(fresh.emodel, fresh.eopt, lora2["dir"], scheduler=fresh.sched)
    assert info["resharded"] and info["world_size"] == 2
    got = fresh.steps(AFTER)
    want = lora2["uninterrupted"]
    assert got["lrs"] == want["lrs"]
    for a, b in zip(want["losses"], got["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (want["losses"], got["losses"])
    state = fresh.emodel.state_dict()
    assert len(adapters(state)) == 4  # lora_A and lora_B of two c_attn layers
    assert_state_close(adapters(lora2["final"]), adapters(state), rtol=1e-5, atol=3e-8, label="adapters")
    # the frozen base is the loading model's own, bit for bit, and the one both runs trained on
    base = lora().state_dict()
    for key in frozen_keys(fresh.model):
        assert torch.equal(state[key], base[key]) and torch.equal(lora2["final"][key], base[key]), key


def _safetensors_keys_and_data_bytes(directory: Path) -> tuple[dict[str, list[str]], dict[str, int]]:
    keys, data = {}, {}
    for f in sorted(directory.glob("*.safetensors")):
        with SafetensorsReader(f) as reader:
            keys[f.name] = reader.keys()
            data[f.name] = sum(s.nbytes for s in reader.specs.values())
    return keys, data


def test_lora_checkpoint_holds_no_frozen_weights(lora2) -> None:
    d = lora2["dir"]
    model = lora()
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    n_trainable = sum(trainable.values())
    frozen_bytes = sum(p.numel() * 4 for p in frozen.values())
    index = json.loads((d / INDEX_NAME).read_text())
    assert index["format_version"] == ck.FORMAT_VERSION == 2
    assert {p["name"] for p in index["params"]} == set(trainable)
    assert [r["name"] for r in index["frozen"]["params"]] == list(frozen)

    keys, data = _safetensors_keys_and_data_bytes(d)
    stored = {k.split("/")[0] for ks in keys.values() for k in ks}
    assert not stored & set(frozen) and not stored & frozen_keys(model), "a frozen weight was written"
    model_bytes = sum(v for f, v in data.items() if f.startswith("model-rank-"))
    optim_bytes = sum(v for f, v in data.items() if f.startswith("optimizer-rank-"))
    assert model_bytes == 4 * n_trainable                          # fp32 master slices, nothing else
    assert optim_bytes == 2 * 4 * n_trainable + 4 * sum(len(p["slices"]) for p in index["params"])
    assert data.get(UNTRACKED_NAME, 0) == 0
    total_files = sum(f.stat().st_size for f in d.iterdir())
    # the whole checkpoint (JSON, config and headers included) is smaller than the base it omits
    assert total_files < 0.5 * frozen_bytes, (total_files, frozen_bytes)
    # the two ranks' shares of each digest add up to the digest of the whole tensor
    for record in index["frozen"]["params"]:
        assert record["digest"]["float32"] == frz.tensor_digest(frozen[record["name"]]), record["name"]
        assert record["digest"]["bfloat16"] == frz.tensor_digest(frozen[record["name"]], torch.bfloat16)


def test_lora_resume_onto_another_base_is_refused_before_anything_changes(lora2) -> None:
    for r in lora2["ranks"]:  # at world size 2, on both ranks (each checked its state)
        assert "frozen weights are not those the checkpoint was trained on" in r["error"]
    # other values: the first differing tensor is named, with both digests
    other = Trained(lora(base_seed=1, adapter_seed=3), 0, 1, RESUME_PLAN)
    error = refusal(other, lora2["dir"], "base_model.model.transformer.wte.weight", "digest", "another base")
    index = json.loads((lora2["dir"] / INDEX_NAME).read_text())
    assert index["frozen"]["params"][0]["digest"]["float32"] in error
    # another shape (a shorter position table): named with both shapes
    short = Trained(lora(n_positions=32), 0, 1, RESUME_PLAN)
    refusal(short, lora2["dir"], "base_model.model.transformer.wpe.weight", "[64, 32]", "[32, 32]")
    # one frozen tensor changed in one element, at the last bit: still refused, and named
    model = lora()
    with torch.no_grad():
        w = model.base_model.model.transformer.h[1].mlp.c_proj.weight
        w.view(-1)[17] = torch.nextafter(w.view(-1)[17], torch.tensor(1e9))
    refusal(Trained(model, 0, 1, RESUME_PLAN), lora2["dir"], "transformer.h.1.mlp.c_proj.weight",
            "1 of 28 frozen tensors differ")


def test_export_refuses_a_checkpoint_without_its_frozen_base(lora2, tmp_path, capsys) -> None:
    from hf_elixir.cli import main

    with pytest.raises(ck.CheckpointError, match="accelerator.save_model") as exc:
        ck.export(lora2["dir"], tmp_path / "out")
    assert "28 frozen tensors" in str(exc.value) and "PeftModel.from_pretrained" in str(exc.value)
    assert not (tmp_path / "out").exists()
    assert main(["export", str(lora2["dir"]), str(tmp_path / "cli")]) == 2
    assert "accelerator.save_model" in capsys.readouterr().err and not (tmp_path / "cli").exists()


# ---------------------------------------------------------------------- frozen embeddings, no PEFT
@pytest.fixture(scope="module")
def emb(tmp_path_factory):
    d = tmp_path_factory.mktemp("emb") / "ckpt"
    run = Trained(frozen_embeddings(), 0, 1, SAVE_PLAN)
    run.steps(BEFORE)
    ck.save(run.emodel, run.eopt, d, scheduler=run.sched)
    want = run.steps(AFTER)
    return {"dir": d, "want": want, "final": run.emodel.state_dict()}


def test_frozen_embeddings_resume_and_are_not_stored(emb) -> None:
    fresh = Trained(frozen_embeddings(), 0, 1, RESUME_PLAN)
    fresh.steps(1)  # its trainable state and schedule now differ from the checkpoint's
    ck.load(fresh.emodel, fresh.eopt, emb["dir"], scheduler=fresh.sched)
    got = fresh.steps(AFTER)
    assert got["lrs"] == emb["want"]["lrs"]
    for a, b in zip(emb["want"]["losses"], got["losses"]):
        assert abs(a - b) <= 1e-6 * abs(a)
    assert_state_close(emb["final"], fresh.emodel.state_dict(), rtol=1e-6, atol=1e-9, label="frozen embeddings")
    index = json.loads((emb["dir"] / INDEX_NAME).read_text())
    assert [r["name"] for r in index["frozen"]["params"]] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert index["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    keys, _ = _safetensors_keys_and_data_bytes(emb["dir"])
    stored = {k.split("/")[0] for ks in keys.values() for k in ks}
    assert not stored & {"transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"}


def test_frozen_embeddings_onto_other_weights_or_freezing_are_refused(emb) -> None:
    refusal(Trained(frozen_embeddings(wpe_scale=3.0), 0, 1, SAVE_PLAN), emb["dir"],
            "'transformer.wpe.weight' has digest", "1 of 2 frozen tensors differ")
    refusal(Trained(frozen_embeddings(freeze_wpe=False), 0, 1, SAVE_PLAN), emb["dir"],
            "'transformer.wpe.weight' was frozen when the checkpoint was saved and is trainable")
    # a checkpoint of the fully trainable model cannot be resumed with weights frozen
    full_ckpt = emb["dir"].parent / "full"
    full = Trained(gpt2(), 0, 1, SAVE_PLAN)
    ck.save(full.emodel, full.eopt, full_ckpt)
    assert json.loads((full_ckpt / INDEX_NAME).read_text())["format_version"] == PLAIN_FORMAT_VERSION
    refusal(Trained(frozen_embeddings(), 0, 1, SAVE_PLAN), full_ckpt,
            "was trainable when the checkpoint was saved and is frozen", "(2 such tensors)")


def test_frozen_digests_across_compute_dtypes(emb, tmp_path) -> None:
    # saved in float32, resumed in bfloat16: compared on the bf16-rounded values
    bf16 = Trained(frozen_embeddings(), 0, 1, dict(SAVE_PLAN, compute_dtype="bf16"))
    ck.load(bf16.emodel, bf16.eopt, emb["dir"])
    refusal(Trained(frozen_embeddings(wpe_scale=3.0), 0, 1, dict(SAVE_PLAN, compute_dtype="bf16")), emb["dir"],
            "'transformer.wpe.weight'", "(bfloat16 values")
    # saved in bfloat16: a float32 model rounds its values to compare; float16 cannot compare
    ck.save(bf16.emodel, bf16.eopt, tmp_path / "bf16")
    saved = json.loads((tmp_path / "bf16" / INDEX_NAME).read_text())["frozen"]
    assert saved["held_dtype"] == "bfloat16" and set(saved["params"][0]["digest"]) == {"bfloat16"}
    fp32 = Trained(frozen_embeddings(), 0, 1, SAVE_PLAN)
    ck.load(fp32.emodel, fp32.eopt, tmp_path / "bf16")
    refusal(Trained(frozen_embeddings(), 0, 1, dict(SAVE_PLAN, compute_dtype="fp16")), tmp_path / "bf16",
            "cannot be compared exactly", "compute dtype bfloat16")


def test_version_1_checkpoints_that_stored_frozen_weights_still_restore_them(emb, tmp_path) -> None:
    """Before frozen chunks, frozen parameters were saved whole in the untracked file; such a
    checkpoint restores them (its values win over the loading model's)."""
    saved_model = frozen_embeddings(wpe_scale=2.0)
    values = {n: p.detach().clone() for n, p in saved_model.named_parameters() if not p.requires_grad}
    old = tmp_path / "v1"
    shutil.copytree(emb["dir"], old)
    index = json.loads((old / INDEX_NAME).read_text())
    with SafetensorsReader(old / UNTRACKED_NAME) as reader:
        kept = [(k, reader.read_tensor(k)) for k in reader.keys()]
    size, digest = write_safetensors(old / UNTRACKED_NAME, kept + list(values.items()))
    index["files"][UNTRACKED_NAME].update(size=size, sha256=digest)
    assert file_sha256(old / UNTRACKED_NAME) == digest
    index["untracked"] += [{"name": n, "shape": list(v.shape), "dtype": "float32"} for n, v in values.items()]
    del index["frozen"]
    index["format_version"] = 1
    (old / INDEX_NAME).write_text(json.dumps(index))

    run = Trained(frozen_embeddings(), 0, 1, SAVE_PLAN)
    ck.load(run.emodel, run.eopt, old)
    state = run.emodel.state_dict()
    for name, value in values.items():
        assert torch.equal(state[name], value), name
