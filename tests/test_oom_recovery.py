"""Out-of-memory recovery between real processes (runtime/recovery.py), through the runtime
and through an unmodified Trainer script under ``hf-elixir launch``.

Two gloo ranks train a tiny GPT-2 through the runtime with an out-of-memory error injected
(``ELIXIR_INJECT_OOM``) in the forward, the backward or the optimizer step, on one rank or
on both. Each run must finish (every test runs under the harness's timeout: a rank left
waiting in a collective fails it), re-plan once, and end with exactly the weights of a run
that adopted the recovered plan at that step without any failure: the failed step is
redone from the same batches, no earlier step is repeated or lost. The reference run
changes plans through the same ``adopt_plan``, so the comparison isolates the recovery.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

import pytest
import torch

import hf_elixir as hfe
from harness import free_port, run_distributed
from hf_elixir.integrations.launch import default_config, write_config
from hf_elixir.integrations.plugin import ElixirPlugin
from hf_elixir.planner.replan import tighten
from hf_elixir.runtime.faults import INJECT_ENV, FaultSpecError, parse_faults
from hf_elixir.runtime.recovery import RecoveryFailed, link_loss, model_loss, origin_of
from hf_elixir.checkpoint import save as save_checkpoint
from hf_elixir.vocab import format_bytes
from integration_helpers import CALIBRATION, CHECKPOINTING_FLAG, SCRIPTS, check, hf_elixir, max_diff, trainer_args, worker_env
from loops import elixir_steps

STEPS = 7


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _batches(rank: int, steps: int, accumulate: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 64, (2, 12), generator=g) for _ in range(steps * accumulate)]


def _run(rank: int, world_size: int, inject: Optional[str], adopt_at: Optional[int], accumulate: int,
         max_attempts: int = 3, searched: bool = False, save_to: Optional[str] = None,
         recover: bool = True) -> dict:
    """Train STEPS steps; ``searched``: on the planner's plan (its recovery options priced)
    instead of a simple one; ``save_to``: write a checkpoint there after step 2; ``recover``:
    the runtime's ``recover_oom``."""
    os.environ[INJECT_ENV] = inject or ""
    model = _model()
    plan = (hfe.plan(model, (2, 12), world_size=world_size, dtype="float32", efficiency="calibrated") if searched
            else hfe.ElixirPlan.simple(model, world_size, chunk_size=8192, prefetch_depth=1))
    emodel = hfe.ElixirModule(model, plan, recover_oom=recover)
    emodel.recovery.max_attempts = max_attempts
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plans = {"start": (plan.activation_checkpointing, plan.rcache_blocks)}

    def each_step(step: int) -> None:
        if step == adopt_at:
            emodel.adopt_plan(tighten(emodel.plan, can_checkpoint=True))
        if step == 3 and save_to:
            save_checkpoint(emodel, opt, save_to)

    try:
        losses = elixir_steps(emodel, opt, _batches(rank, STEPS, accumulate), accumulate=accumulate, clip=0.5,
                              each_step=each_step)
    except RecoveryFailed as exc:
        return {"error": str(exc), "plan": plan.to_dict()}
    except torch.OutOfMemoryError as exc:  # only without recovery
        return {"raised": str(exc), "step": emodel.recovery.step, "recorded": len(emodel.comm.schedule.templates)}
    state = {k: v.detach().clone() for k, v in emodel.state_dict().items()}
    plans["end"] = (emodel.plan.activation_checkpointing, emodel.plan.rcache_blocks)
    return {"state": state, "losses": losses, "events": emodel.recovery.log.events, "plans": plans,
            "steps": opt.module.recovery.step}


@pytest.fixture(scope="module")
def reference():
    """Per accumulation: the run that adopts the recovered plan at step 3 (and at step 4, for
    the optimizer-step failure, whose re-plan is adopted at the next step) without failing."""
    return {(acc, at): run_distributed(_run, 2, None, at, acc) for acc, at in ((1, 3), (1, 4), (2, 4))}


CASES = [  # (injection, accumulation, the step whose plan changes)
    ("3:forward:1", 1, 3),
    ("3:backward:0", 1, 3),
    ("3:forward", 1, 3),
    ("3:backward", 1, 3),
    ("3:optimizer:1", 1, 4),
    ("4:backward:1", 2, 4),   # rank 1 fails in a later micro-batch: the whole step is redone
]


@pytest.mark.parametrize("inject, accumulate, at", CASES, ids=[c[0] + f"-acc{c[1]}" for c in CASES])
def test_recovered_run_equals_a_run_on_the_recovered_plan(reference, inject, accumulate, at) -> None:
    got = run_distributed(_run, 2, inject, None, accumulate)
    ref = reference[(accumulate, at)]
    for rank in (0, 1):
        assert "error" not in got[rank], got[rank].get("error")
        assert got[rank]["steps"] == STEPS  # no step lost or repeated
        assert got[rank]["plans"]["start"] == (False, got[rank]["plans"]["start"][1])
        assert got[rank]["plans"]["end"] == ref[rank]["plans"]["end"]  # checkpointing turned on
        assert [e.get("change") for e in got[rank]["events"] if e.get("change")] == ["activation checkpointing on"]
        for name, value in ref[rank]["state"].items():
            diff = (got[rank]["state"][name] - value).abs().max().item()
            assert diff <= 1e-6, f"rank {rank}: {name} differs by {diff:.2e} from the run on the recovered plan"
    # every step's loss but the failed one's is the reference's (that one is the redo's)
    assert len(got[0]["losses"]) == STEPS


def _digests(directory: Path) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def test_repeated_failures_stop_with_a_clear_error(tmp_path) -> None:
    """Failures beyond ``max_attempts`` raise RecoveryFailed on every rank, naming the smallest
    memory per device that would fit (the planner's figure), and the checkpoint saved before
    them is byte for byte what was written."""
    saved = tmp_path / "ckpt"
    got = run_distributed(_run, 2, "4:forward:0,6:backward:1", None, 1, 1, True, str(saved))
    written = _digests(saved)
    assert written and any(name.endswith(".safetensors") for name in written)
    for rank in (0, 1):
        assert "error" in got[rank], got[rank]
        error, predictions = got[rank]["error"], got[rank]["plan"]["predictions"]
        assert "after 1 recoveries" in error and "Nothing saved was touched" in error
        smallest = format_bytes(predictions["smallest_peak_bytes"])
        assert f"The smallest memory per device that would fit this model is {smallest} at batch 2" in error
        assert "The plan that failed was predicted to need" in error
    assert _digests(saved) == written


def test_opting_out_raises_the_error_and_records_nothing() -> None:
    """With ``recover_oom=False`` the out-of-memory error reaches the script in the step it
    happened (both ranks fail, so neither waits for the other), and the runtime recorded no
    collective schedule for a recovery it will not make."""
    got = run_distributed(_run, 2, "3:forward", None, 1, 3, False, None, False)
    for rank in (0, 1):
        assert "raised" in got[rank], got[rank]
        assert "injected" in got[rank]["raised"] and got[rank]["step"] == 3
        assert got[rank]["recorded"] == 0


def test_fault_spec_is_checked() -> None:
    assert parse_faults("3:forward:1, 5:backward") == [
        *parse_faults("3:forward:1"), *parse_faults("5:backward")]
    for bad in ("3:sideways", "x:forward", "3:forward:one", "3"):
        with pytest.raises(FaultSpecError, match="STEP:PHASE"):
            parse_faults(bad)


def test_loss_scaling_is_recognised_and_nothing_else() -> None:
    """The redo rebuilds a loss only from a constant scaling of the model's loss, in place
    (as the Trainer does) or not."""
    def factor(change):
        source = torch.tensor(2.0, requires_grad=True) * 1.5
        origin = origin_of(source)
        link = link_loss(change(source), origin)
        return None if link is None else link.factor()

    def in_place(t):
        t *= 4
        return t / 2

    assert factor(lambda t: t / 4) == pytest.approx(0.25)
    assert factor(lambda t: t * 3) == pytest.approx(3.0)
    assert factor(lambda t: t) == 1.0
    assert factor(in_place) == pytest.approx(2.0)
    assert factor(lambda t: t ** 2) is None
    assert factor(lambda t: t.add_(1) / 2) is None  # an in-place shift is not a scaling
    assert factor(lambda t: torch.tensor(1.0, requires_grad=True)) is None
    source = torch.tensor(2.0, requires_grad=True) * 1.5
    assert model_loss({"loss": source}) is source and model_loss((source, 1)) is source


# CALIBRATION (integration_helpers): the plans and the levers recovery picks are priced with it
# on every machine (a calibration measured where the tests run made CI's recovery turn the
# rCache down where this machine's turned checkpointing on: both right for their figures, but a
# test that names the lever must fix the figures it is priced with)


@pytest.fixture(scope="module", autouse=True)
def fixed_calibration(tmp_path_factory):
    """This module's runs, in this process and the launched ones, read CALIBRATION as this
    machine's cached calibration (``efficiency: calibrated`` and ``HardwareProfile.detect``)."""
    from hf_elixir.hardware import HardwareProfile, cache_path

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ELIXIR_CACHE", str(tmp_path_factory.mktemp("calibration")))
        HardwareProfile.from_json(CALIBRATION).to_json(cache_path())
        yield


def _config(directory: Path, **plugin) -> Path:
    path = directory / ("elixir.yaml" if not plugin else "elixir_budget.yaml")
    # priced by the calibrated efficiency, not one timed here: the same plans under any load
    write_config(path, default_config(2, use_gpu=False), ElixirPlugin(plan="auto", efficiency="calibrated", **plugin))
    return path


def _trainer_run(directory: Path, name: str, config: Path, *flags: str, inject: str = ""):
    """The integration tests' Trainer script, unmodified, under ``hf-elixir launch``."""
    proc = check(hf_elixir("launch", "--config_file", str(config), "--main_process_port", str(free_port()),
                           str(SCRIPTS / "trainer_run.py"), "--output_dir", str(directory / name), "--result",
                           str(directory / f"{name}.pt"), *flags, cwd=directory,
                           env=worker_env(ELIXIR_INJECT_OOM=inject)))
    return torch.load(directory / f"{name}.pt"), proc


def _logged(result: dict, key: str) -> list[float]:
    return [h[key] for h in result["log_history"] if key in h and "eval_loss" not in h]


def _assert_same_training(got: dict, ref: dict, rel: float, weights: float) -> None:
    """The same optimizer steps, LR schedule, logged losses and norms, evals and weights."""
    assert got["global_step"] == ref["global_step"] == 6
    assert _logged(got, "learning_rate") == _logged(ref, "learning_rate")
    for key in ("loss", "grad_norm"):
        assert len(_logged(got, key)) == 6 and _logged(got, key) == pytest.approx(_logged(ref, key), rel=rel), key
    assert got["evals"] == pytest.approx(ref["evals"], rel=rel)
    assert max_diff(got["state"], ref["state"]) < weights


def test_stock_trainer_script_recovers_unchanged(tmp_path) -> None:
    """The Trainer script (accumulation 2, clipping, evaluation every 3 steps) with rank 1
    running out of memory in the backward of step 2: it finishes the same 6 steps with the
    same learning rates, logs the losses and norms of the run without the failure (the
    failed step's too, from its redo), and ends where that run ends (the recovered plan turns
    activation checkpointing on and holds fewer chunks, which changes no arithmetic)."""
    config = _config(tmp_path)
    clean, _ = _trainer_run(tmp_path, "clean", config, *trainer_args())
    hurt, proc = _trainer_run(tmp_path, "hurt", config, *trainer_args(), inject="2:backward:1")
    assert "out of memory in step 2; recovered with a new plan (activation checkpointing on" in proc.stderr, \
        proc.stderr[-3000:]
    _assert_same_training(hurt, clean, rel=1e-6, weights=1e-6)


#: the model of tests/scripts/trainer_run.py
def _trainer_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


@pytest.fixture(scope="module")
def small_batch_run(tmp_path_factory):
    """The reference of the micro-batch lever: the Trainer script started with per-device
    batch 1 and accumulation 4 (the same global batch as 2 x 2)."""
    d = tmp_path_factory.mktemp("small_batch")
    return _trainer_run(d, "small", _config(d), *trainer_args(per_device_train_batch_size="1",
                                                                gradient_accumulation_steps="4"))[0]


def test_recovery_halves_the_micro_batch_and_keeps_the_global_batch(small_batch_run, tmp_path) -> None:
    """Acceptance 2 and 3: with the model's own checkpointing on (no checkpointing lever),
    the cost model's cheapest plan under the memory target after rank 1 fails in step 2 runs
    each batch of 2 as 2 micro-batches of 1. With ``auto_find_batch_size`` on, the run keeps
    its 6 steps and LR schedule, and its logged losses, norms, evals and weights are those of
    the run started with batch 1 and accumulation 4."""
    hurt, proc = _trainer_run(tmp_path, "hurt", _config(tmp_path), *trainer_args(), CHECKPOINTING_FLAG,
                              "true", "--auto_find_batch_size", "true", inject="2:backward:1")
    assert "recovered with a new plan (micro-batch split 1 -> 2 (the same global batch)" in proc.stderr
    _assert_same_training(hurt, small_batch_run, rel=1e-5, weights=1e-5)


def test_auto_find_batch_size_plans_smaller_micro_batches(small_batch_run, tmp_path) -> None:
    """Acceptance 3, the planner's own choice first: on a budget no plan for batch 2 fits but
    one for batch 1 does, ``auto_find_batch_size`` plans micro-batches of 1, two per batch;
    the run equals the one started with batch 1 and accumulation 4. Without it, the plan
    error says what would fit."""
    model = _trainer_model()
    two = hfe.plan(model, (2, 16), world_size=2, dtype="float32", efficiency="calibrated").predictions["smallest_peak_bytes"]
    one = hfe.plan(model, (1, 16), world_size=2, dtype="float32", efficiency="calibrated").predictions["smallest_peak_bytes"]
    assert one < two
    budget = (one + two) // 2
    config = _config(tmp_path, gpu_memory=f"{budget}B")
    split, proc = _trainer_run(tmp_path, "split", config, *trainer_args(), "--auto_find_batch_size", "true")
    assert "runs as 2 micro-batches of 1" in proc.stdout
    _assert_same_training(split, small_batch_run, rel=1e-5, weights=1e-5)
    refused = hf_elixir("launch", "--config_file", str(config), "--main_process_port", str(free_port()),
                        str(SCRIPTS / "trainer_run.py"), "--output_dir", str(tmp_path / "refused"),
                        "--result", str(tmp_path / "refused.pt"), *trainer_args(), cwd=tmp_path)
    assert refused.returncode != 0 and "no plan fits" in refused.stdout + refused.stderr
    assert "the largest per-device batch size that fits" in refused.stdout + refused.stderr
