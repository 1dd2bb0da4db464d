"""Checkpoints (issue 4): format, exact resume, reshard, export, streaming, bad input.

One 2-rank run (module fixture) trains GPT-2 2 steps, saves, records the logits, trains 3
more steps (the uninterrupted run), then resumes a fresh model from the checkpoint in the
same processes, and checks that a rank file corrupted under one rank fails on both.
The other tests load that checkpoint at world sizes 1 and 3 under other plans, export it,
and damage copies of it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_elixir as hfe
from ckpt_common import Run, assert_same_local_state
from equivalence import assert_state_close
from harness import run_distributed
from hf_elixir import checkpoint as ck
from hf_elixir.checkpoint.index import INDEX_NAME, PLAIN_FORMAT_VERSION, UNTRACKED_NAME
from tiny_models import VOCAB

ROOT = Path(__file__).resolve().parent.parent
SAVE_PLAN = dict(chunk_size=4096)


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")


# ---------------------------------------------------------------------- the 2-rank run
def _train_save_resume(rank: int, world_size: int, ckdir: str) -> dict:
    run = Run(rank, world_size, plan_kwargs=SAVE_PLAN)
    before = run.steps(2)
    gathers = []
    real_gather = run.emodel.comm.all_gather
    run.emodel.comm.all_gather = lambda *a, **k: gathers.append(1) or real_gather(*a, **k)
    extra = {"step": 2, "note": "two steps"}
    if rank == 0:
        extra["tokenizer"] = make_tokenizer()
    ck.save(run.emodel, run.eopt, ckdir, extra=extra, scheduler=run.sched)
    run.emodel.comm.all_gather = real_gather
    logits = run.logits()
    uninterrupted = run.steps(3)
    final = run.emodel.state_dict()

    fresh = Run(rank, world_size, plan_kwargs=SAVE_PLAN, seed=1)
    fresh.steps(1)  # its state and schedule now differ from the checkpoint's
    info = ck.load(fresh.emodel, fresh.eopt, ckdir, scheduler=fresh.sched)
    resumed = fresh.steps(3)
    resumed_final = fresh.emodel.state_dict()

    # a file that only rank 1 reads is corrupted: both ranks refuse, neither changes
    bad = ckdir + "-bad"
    if rank == 0:
        shutil.copytree(ckdir, bad)
        path = Path(bad) / "model-rank-00001-of-00002.safetensors"
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    dist.barrier()
    snapshot = fresh.local_state()
    try:
        ck.load(fresh.emodel, fresh.eopt, bad)
        corrupt_error = None
    except ck.CheckpointError as e:
        corrupt_error = str(e)
    assert_same_local_state(snapshot, fresh.local_state())
    return {"before": before, "uninterrupted": uninterrupted, "resumed": resumed, "info": info,
            "final": final if rank == 0 else None, "resumed_final": resumed_final if rank == 0 else None,
            "logits": logits, "gathers": len(gathers), "corrupt_error": corrupt_error}


@pytest.fixture(scope="module")
def saved2(tmp_path_factory):
    ckdir = str(tmp_path_factory.mktemp("ck2") / "ckpt")
    results = run_distributed(_train_save_resume, 2, ckdir)
    return {"dir": ckdir, "ranks": results, **results[0]}


def test_resume_at_the_same_world_size_is_bit_identical(saved2) -> None:
    assert saved2["resumed"]["losses"] == saved2["uninterrupted"]["losses"]
    assert saved2["resumed"]["lrs"] == saved2["uninterrupted"]["lrs"]
    assert saved2["uninterrupted"]["lrs"][0] != saved2["before"]["lrs"][0]  # the schedule moved
    for key, want in saved2["final"].items():
        assert torch.equal(saved2["resumed_final"][key], want), key
    assert saved2["info"]["extra"] == {"step": 2, "note": "two steps"} and not saved2["info"]["resharded"]


def test_save_is_collective_but_never_gathers(saved2) -> None:
    assert [r["gathers"] for r in saved2["ranks"]] == [0, 0]


def test_corrupt_file_of_one_rank_fails_on_every_rank_and_changes_nothing(saved2) -> None:
    for r in saved2["ranks"]:  # each rank also checked its own state is unchanged
        assert r["corrupt_error"] and "model-rank-00001-of-00002.safetensors" in r["corrupt_error"]
        assert "sha256" in r["corrupt_error"]
    assert "reported by rank 1" in saved2["ranks"][0]["corrupt_error"]


def test_index_records_the_layout(saved2) -> None:
    from safetensors import safe_open

    d = Path(saved2["dir"])
    index = json.loads((d / INDEX_NAME).read_text())
    # a model without frozen parameters keeps the version-1 format (no "frozen" entry)
    assert index["format_version"] == PLAIN_FORMAT_VERSION == 1 and index["world_size"] == 2
    assert "frozen" not in index
    plan = hfe.ElixirPlan.from_dict(index["plan"])
    assert plan.digest() == index["plan_digest"] and plan.chunk_size == 4096
    names = plan.param_names()
    assert [p["name"] for p in index["params"]] == names
    for p in index["params"]:
        assert set(p) >= {"name", "shape", "dtype", "chunk", "offset", "slices"}
        assert p["name"] in plan.chunks[p["chunk"]].params and p["dtype"] == "float32"
    assert set(index["files"]) >= {"model-rank-00000-of-00002.safetensors", "model-rank-00001-of-00002.safetensors",
                                   "optimizer-rank-00000-of-00002.safetensors", "optimizer-rank-00001-of-00002.safetensors",
                                   UNTRACKED_NAME, "optimizer_state.json", "config.json", "tokenizer.json"}
    for name, info in index["files"].items():
        assert (d / name).stat().st_size == info["size"] and len(info["sha256"]) == 64
    state = json.loads((d / "optimizer_state.json").read_text())
    assert [g["weight_decay"] for g in state["param_groups"]] == [0.1, 0.0]
    assert state["param_groups"][0]["betas"] == [0.9, 0.999] and state["algorithm"] == "adamw"
    # the rank files are ordinary safetensors; the slices of each parameter tile it exactly
    total = {p["name"]: 0 for p in index["params"]}
    for r in range(2):
        with safe_open(str(d / f"model-rank-{r:05d}-of-00002.safetensors"), "pt") as f:
            for key in f.keys():
                total[key] += f.get_tensor(key).numel()
        with safe_open(str(d / f"optimizer-rank-{r:05d}-of-00002.safetensors"), "pt") as f:
            assert {k.rsplit("/", 1)[1] for k in f.keys()} == {"exp_avg", "exp_avg_sq", "step"}
    assert all(total[p["name"]] == p["numel"] for p in index["params"])


# ---------------------------------------------------------------------- reshard
def _continue(rank: int, world_size: int, ckdir: str, plan_kwargs: dict, steps: int) -> dict:
    run = Run(rank, world_size, plan_kwargs=plan_kwargs, seed=2)
    info = ck.load(run.emodel, run.eopt, ckdir, scheduler=run.sched)
    out = run.steps(steps)
    state = run.emodel.state_dict()  # collective
    out["state"] = state if rank == 0 else None
    out["info"] = info
    return out


def _assert_continues(saved2, got: dict) -> None:
    want = saved2["uninterrupted"]
    assert got["info"]["resharded"]
    assert got["lrs"] == want["lrs"]
    for a, b in zip(want["losses"], got["losses"]):
        assert abs(a - b) <= 1e-6 * abs(a), (want["losses"], got["losses"])
    assert_state_close(saved2["final"], got["state"], rtol=1e-6, atol=1e-9, label="resharded")


def test_reshard_to_world_size_1_with_another_chunk_size_and_offload(saved2) -> None:
    plan = dict(chunk_size=8192, offload_fraction=0.5, offload_params=True, rcache_blocks=2)
    _assert_continues(saved2, _continue(0, 1, saved2["dir"], plan, 3))


def test_reshard_to_world_size_3_with_another_plan(saved2) -> None:
    plan = dict(chunk_size=6000, offload_fraction=1.0)
    got = run_distributed(_continue, 3, saved2["dir"], plan, 3)
    _assert_continues(saved2, got[0])


# ---------------------------------------------------------------------- export
def _hf_logits(folder: Path, ids: torch.Tensor, dtype=None):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True,
                                                       attn_implementation="eager", dtype=dtype)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits, model


def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(saved2, tmp_path) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "hf"
    info = ck.export(saved2["dir"], out)
    assert info["files"] == ["model.safetensors"]
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= set(
        p.name for p in out.iterdir())
    ids = Run(0, 1).ids[:4]
    logits, _ = _hf_logits(out, ids)
    torch.testing.assert_close(logits, saved2["logits"], rtol=1e-5, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("t5 t7 t95")["input_ids"] == [5, 7, 95]


def test_export_bf16_in_shards_through_the_cli(saved2, tmp_path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "hf16"
    proc = subprocess.run([sys.executable, "-m", "hf_elixir.cli", "export", saved2["dir"], str(out),
                           "--dtype", "bf16", "--max-shard-size", "40KB"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and all((out / f).stat().st_size <= 40_000 + 4096 for f in files)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    weights = {}
    for f in files:
        weights.update(load_file(str(out / f)))
    fp32 = tmp_path / "hf32"
    ck.export(saved2["dir"], fp32)
    full = load_file(str(fp32 / "model.safetensors"))
    assert set(full) == set(weights)
    for key, t in full.items():
        assert weights[key].dtype == torch.bfloat16 and torch.equal(weights[key], t.to(torch.bfloat16)), key
    ids = Run(0, 1).ids[:4]
    logits, model = _hf_logits(out, ids)
    assert model.dtype == torch.bfloat16
    assert (logits.float() - saved2["logits"]).abs().max() < 0.1
    bad = subprocess.run([sys.executable, "-m", "hf_elixir.cli", "export", str(tmp_path / "nothing"),
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no such directory" in bad.stderr


@pytest.mark.parametrize("arch", ["llama", "opt", "mixtral"])
def test_export_other_architectures(arch, tmp_path) -> None:
    run = Run(0, 1, arch=arch, plan_kwargs=dict(chunk_size=16384, offload_fraction=0.5))
    run.steps(1)
    ck.save(run.emodel, run.eopt, tmp_path / "ck")
    ck.export(tmp_path / "ck", tmp_path / "hf")
    logits, _ = _hf_logits(tmp_path / "hf", run.ids[:4])
    torch.testing.assert_close(logits, run.logits(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- other optimizers, precisions
@pytest.mark.parametrize("opt_kind,dtype", [("sgd", "fp32"), ("adam", "fp16")])
def test_resume_sgd_momentum_and_fp16_loss_scaler(opt_kind, dtype, tmp_path) -> None:
    plan = dict(chunk_size=4096, compute_dtype=dtype, offload_fraction=0.5)
    run = Run(0, 1, plan_kwargs=plan, opt_kind=opt_kind)
    run.steps(2)
    if run.eopt.scaler is not None:
        run.eopt.scaler.scale = 1024.0
        run.eopt.scaler.clean_steps = 7
    ck.save(run.emodel, run.eopt, tmp_path / "ck", scheduler=run.sched)
    want = run.steps(2)
    fresh = Run(0, 1, plan_kwargs=plan, opt_kind=opt_kind, seed=3)
    ck.load(fresh.emodel, fresh.eopt, tmp_path / "ck", scheduler=fresh.sched)
    if fresh.eopt.scaler is not None:
        assert fresh.eopt.scaler.scale == 1024.0 and fresh.eopt.scaler.clean_steps == 7
    assert fresh.steps(2) == want


# frozen parameters are recorded by digest, not stored: tests/test_checkpoint_frozen.py


# ---------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def saved1(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck1") / "ckpt"
    run = Run(0, 1)
    run.steps(1)
    ck.save(run.emodel, run.eopt, d, scheduler=run.sched)
    return d


@pytest.fixture()
def victim():
    run = Run(0, 1, seed=4)
    run.steps(1)
    return run


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _expect_refusal(victim: Run, directory, *needles: str, export_too: bool = True) -> str:
    before = victim.local_state()
    with pytest.raises(ck.CheckpointError) as exc:
        ck.load(victim.emodel, victim.eopt, directory, scheduler=victim.sched)
    assert_same_local_state(before, victim.local_state())
    for needle in needles:
        assert needle in str(exc.value), str(exc.value)
    if export_too:  # export refuses too (it reads no optimizer state and needs no model)
        with pytest.raises(ck.CheckpointError) as exc2:
            ck.export(directory, Path(str(directory) + "-export"))
        assert needles[0] in str(exc2.value), str(exc2.value)
    return str(exc.value)


def test_truncated_rank_file(saved1, victim, tmp_path) -> None:
    d = _copy(saved1, tmp_path)
    f = d / "model-rank-00000-of-00001.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _expect_refusal(victim, d, str(f), "truncated")


def test_corrupted_bytes_are_caught_by_the_hash(saved1, victim, tmp_path) -> None:
    for name in ("optimizer-rank-00000-of-00001.safetensors", "model-rank-00000-of-00001.safetensors"):
        d = _copy(saved1, tmp_path / name)
        f = d / name
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x40
        f.write_bytes(bytes(data))
        _expect_refusal(victim, d, str(f), "corrupted", export_too=name.startswith("model"))


def test_corrupted_header_without_hash_check(saved1, victim, tmp_path) -> None:
    d = _copy(saved1, tmp_path)
    f = d / "model-rank-00000-of-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[12:20] = b"\x00\xff\x00\xff\x00\xff\x00\xff"
    f.write_bytes(bytes(data))
    before = victim.local_state()
    with pytest.raises(ck.CheckpointError, match="model-rank-00000-of-00001.safetensors"):
        ck.load(victim.emodel, victim.eopt, d, verify=False)
    assert_same_local_state(before, victim.local_state())


def test_missing_rank_file(saved1, victim, tmp_path) -> None:
    d = _copy(saved1, tmp_path)
    (d / "optimizer-rank-00000-of-00001.safetensors").unlink()
    _expect_refusal(victim, d, "optimizer-rank-00000-of-00001.safetensors", "missing")


def test_missing_rank_file_of_a_two_rank_checkpoint(saved2, victim, tmp_path) -> None:
    d = _copy(Path(saved2["dir"]), tmp_path)
    (d / "model-rank-00001-of-00002.safetensors").unlink()
    _expect_refusal(victim, d, "model-rank-00001-of-00002.safetensors", "missing")


def test_index_from_another_model_names_differ(saved1, tmp_path) -> None:
    llama = Run(0, 1, arch="llama", plan_kwargs=dict(chunk_size=8192))
    d = tmp_path / "llama"
    ck.save(llama.emodel, llama.eopt, d)
    gpt2 = Run(0, 1)
    _expect_refusal(gpt2, d, "another model", "model.layers.0", export_too=False)


def test_index_from_another_model_shapes_differ(saved1, tmp_path) -> None:
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    from equivalence import make_optimizer

    opt, sched = make_optimizer(model)
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096))
    ck.save(em, hfe.ElixirOptimizer(em, opt), tmp_path / "short")
    _expect_refusal(Run(0, 1), tmp_path / "short", "transformer.wpe.weight", "[32, 32]", "[64, 32]", export_too=False)


def test_format_version_from_the_future(saved1, victim, tmp_path) -> None:
    d = _copy(saved1, tmp_path)
    index = json.loads((d / INDEX_NAME).read_text())
    index["format_version"] = ck.FORMAT_VERSION + 1
    (d / INDEX_NAME).write_text(json.dumps(index))
    _expect_refusal(victim, d, str(d / INDEX_NAME), "newer", "upgrade hf_elixir")


def test_directories_that_are_not_checkpoints(saved1, victim, tmp_path) -> None:
    _expect_refusal(victim, tmp_path / "absent", "no such directory")
    (tmp_path / "empty").mkdir()
    _expect_refusal(victim, tmp_path / "empty", "not an hf_elixir checkpoint")
    ck.export(saved1, tmp_path / "hf")
    _expect_refusal(victim, tmp_path / "hf", "not an hf_elixir checkpoint", "from_pretrained")
    (tmp_path / "file").write_text("x")
    _expect_refusal(victim, tmp_path / "file", "not a directory")
    # an interrupted first save is reported, never loaded
    partial = _copy(saved1, tmp_path)
    partial.rename(tmp_path / "ckpt.tmp-0123456789ab")
    (partial.parent / "ckpt.tmp-0123456789ab" / INDEX_NAME).unlink()
    _expect_refusal(victim, partial, "interrupted save", "ckpt.tmp-0123456789ab")


def test_save_refuses_to_replace_a_folder_that_is_not_a_checkpoint(victim, tmp_path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(ck.CheckpointError, match="refusing to replace"):
        ck.save(victim.emodel, victim.eopt, target)
    assert (target / "notes.txt").read_text() == "keep me"
    with pytest.raises(ck.CheckpointError, match="cannot store"):
        ck.save(victim.emodel, victim.eopt, tmp_path / "x", extra={"obj": object()})
    assert not (tmp_path / "x").exists()


def test_optimizer_of_another_kind(saved1) -> None:
    sgd = Run(0, 1, opt_kind="sgd")
    _expect_refusal(sgd, saved1, "adamw", "sgd", export_too=False)


# ---------------------------------------------------------------------- streaming
def test_export_and_save_memory_stay_far_below_the_model_size(tmp_path) -> None:
    """A 24-layer model whose largest tensor is ~4% of it; bench_export measures both."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_export.py"), "--n-layer", "24",
                           "--n-embd", "256", "--vocab", "8192", "--work", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["model_bytes"] > 70e6
    assert r["export"]["peak_rss_delta"] < 0.25 * r["model_bytes"], r
    assert r["save"]["peak_rss_delta"] < 0.25 * r["model_bytes"], r
    assert r["export"]["outputs_equal"]
