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

import os
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
from integration_helpers import SCRIPTS, check, hf_elixir, max_diff, trainer_args, worker_env
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
         max_attempts: int = 3) -> dict:
    os.environ[INJECT_ENV] = inject or ""
    model = _model()
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=8192, prefetch_depth=1)
    emodel = hfe.ElixirModule(model, plan)
    emodel.recovery.max_attempts = max_attempts
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plans = {"start": (plan.activation_checkpointing, plan.rcache_blocks)}

    def each_step(step: int) -> None:
        if step == adopt_at:
            emodel.adopt_plan(tighten(emodel.plan, can_checkpoint=True))

    try:
        losses = elixir_steps(emodel, opt, _batches(rank, STEPS, accumulate), accumulate=accumulate, clip=0.5,
                              each_step=each_step)
    except RecoveryFailed as exc:
        return {"error": str(exc)}
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


def test_repeated_failures_stop_with_a_clear_error() -> None:
    """Failures beyond ``max_attempts`` raise RecoveryFailed, naming the memory the plan needs."""
    got = run_distributed(_run, 2, "3:forward:0,6:backward:1", None, 1, 1)
    for rank in (0, 1):
        assert "error" in got[rank], got[rank]
        assert "after 1 recoveries" in got[rank]["error"] and "Nothing saved was touched" in got[rank]["error"]


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


def test_stock_trainer_script_recovers_unchanged(tmp_path) -> None:
    """The Trainer script of the integration tests, unmodified, under ``hf-elixir launch``
    (accumulation 2, clipping, evaluation every 3 steps) with rank 1 running out of memory in
    the backward of step 2: it finishes the same 6 steps with the same learning rates, and
    ends where the run without the failure ends (the recovered plan only turns activation
    checkpointing on, which changes no arithmetic)."""
    write_config(tmp_path / "elixir.yaml", default_config(2, use_gpu=False), ElixirPlugin(plan="auto"))
    runs = {}
    for name, inject in (("clean", ""), ("hurt", "2:backward:1")):
        proc = check(hf_elixir("launch", "--config_file", str(tmp_path / "elixir.yaml"), "--main_process_port",
                               str(free_port()), str(SCRIPTS / "trainer_run.py"), "--output_dir",
                               str(tmp_path / name), "--result", str(tmp_path / f"{name}.pt"), *trainer_args(),
                               cwd=tmp_path, env=worker_env(ELIXIR_INJECT_OOM=inject)))
        runs[name] = (torch.load(tmp_path / f"{name}.pt"), proc)
    (clean, _), (hurt, proc) = runs["clean"], runs["hurt"]
    assert "out of memory in step 2; recovered with a new plan (activation checkpointing on)" in proc.stderr
    assert hurt["global_step"] == clean["global_step"] == 6
    rates = lambda r: [h["learning_rate"] for h in r["log_history"] if "learning_rate" in h]  # noqa: E731
    assert rates(hurt) == rates(clean)
    assert hurt["evals"] == pytest.approx(clean["evals"], rel=1e-6)
    assert max_diff(hurt["state"], clean["state"]) < 1e-6
