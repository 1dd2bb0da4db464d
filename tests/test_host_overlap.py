"""The host's optimizer updates run behind the next forward (runtime/host_update.py).

On a CPU device at world size 1, half of the chunks keep their optimizer state "on the
host" (the plan's placement; on a CPU the same memory, updated on the host thread all the
same). Each rank runs in a process of its own, torch on 2 threads.

- The overlap is shown, not inferred from timings: each update on the host thread waits
  until the next forward has begun (a hook on the first module sets an event). Were the
  forward to wait for the updates first, they would wait in vain and the test fail.
- The weights after training equal, bit for bit, those of the same run with the updates
  inside ``step()`` (``overlap_host=False``), in fp32 and in bf16.
- The breakdown reports the overlap: host work that ran while the main thread went on.
"""

from __future__ import annotations

import threading

import torch

import hf_elixir as hfe
from harness import run_distributed

STEPS = 4


def _train(rank: int, world_size: int, overlap: bool, dtype: str, accumulate: int = 1) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=1 << 15, offload_fraction=0.5, compute_dtype=dtype)
    emodel = hfe.ElixirModule(model, plan)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the learning rate changes every step, as soon as step() returns: the updates still
    # running on the thread must use the step's own
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0 / (1 + step))
    opt = hfe.ElixirOptimizer(emodel, inner, overlap_host=overlap)
    forward_began = threading.Event()
    model.transformer.wte.register_forward_pre_hook(lambda *_: forward_began.set())
    waits: list[bool] = []
    update = opt._update

    def update_after_the_forward_began(*args, **kwargs):
        if threading.current_thread().name == "hf_elixir_host_update":
            waits.append(forward_began.wait(timeout=20))
        return update(*args, **kwargs)

    opt._update = update_after_the_forward_began
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        batches = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(accumulate)]
        for ids in batches:
            opt.backward(emodel(input_ids=ids, labels=ids).loss / accumulate)
        opt.clip_grad_norm_(1.0)
        forward_began.clear()  # the updates this step queues wait for the next forward
        opt.step()
        scheduler.step()
        opt.zero_grad()
    forward_began.set()  # no forward follows the last step: release its updates
    state = emodel.state_dict()  # waits for them
    return {"state": state, "waits": waits, "report": emodel.time_report(), "optimizer": opt.state_dict(),
            "host_chunks": len(opt.host_chunks)}


def test_the_next_forward_runs_while_the_host_updates_and_the_weights_are_the_same() -> None:
    for dtype in ("float32", "bfloat16"):
        overlapped, = run_distributed(_train, 1, True, dtype)
        inline, = run_distributed(_train, 1, False, dtype)
        assert overlapped["host_chunks"] >= 2
        # each step's host chunks were updated on the thread, and each update went on only
        # once the next forward had begun
        assert overlapped["waits"] == [True] * STEPS * overlapped["host_chunks"]
        assert inline["waits"] == []  # updated inside step(): nothing ran on the thread
        for name, value in inline["state"].items():
            assert torch.equal(overlapped["state"][name], value), (dtype, name)
        for index, entry in inline["optimizer"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(overlapped["optimizer"]["state"][index][key], value), (dtype, index, key)
        measured = overlapped["report"]["measured"]
        assert measured["background"] > 0 and measured["overlap"] > 0
        # per step, overlap is the background work the main thread did not wait for; the
        # report's means average each phase over the steps, so the identity is checked on a
        # step (the mean of differences and the difference of means part in the last bit)
        last = overlapped["report"]["last"]
        assert last["overlap"] == max(0.0, last["background"] - last["exposed_cpu"])
        assert inline["report"]["measured"]["background"] == 0 and inline["report"]["measured"]["cpu_optimizer"] > 0


def test_two_ranks_with_accumulation_train_as_without_the_thread() -> None:
    """World size 2 (gathers and reductions between real processes) with two micro-batches
    a step: the next pass fetches and reduces chunks while the host thread still updates
    others, and the weights are those of the run without it."""
    overlapped = run_distributed(_train, 2, True, "float32", 2)
    inline = run_distributed(_train, 2, False, "float32", 2)
    for a, b in zip(overlapped, inline):
        for name, value in b["state"].items():
            assert torch.equal(a["state"][name], value), name


def _saved_right_after_a_step(rank: int, world_size: int, overlap: bool, directory: str) -> dict:
    """Train 2 steps and save a checkpoint as soon as ``step()`` returns, with the host
    thread slowed (each update starts 50 ms late): a reader that did not wait for it would
    save half-updated state. Returns the exported weights."""
    import time
    from pathlib import Path

    from safetensors.torch import load_file

    import hf_elixir.checkpoint as ck
    from hf_elixir.runtime import host_update

    run_jobs = host_update.HostUpdates._run

    def late(self, jobs):
        return run_jobs(self, [(cid, (lambda u=u: (time.sleep(0.05), u())), p) for cid, u, p in jobs])

    host_update.HostUpdates._run = late
    from ckpt_common import Run

    run = Run(rank, world_size, arch="llama", plan_kwargs=dict(chunk_size=16384, offload_fraction=0.5))
    run.eopt.overlap_host = overlap
    run.steps(2)
    out = Path(directory) / ("overlap" if overlap else "inline")
    ck.save(run.emodel, run.eopt, out / "ck")
    ck.export(out / "ck", out / "hf")
    return {name: value for f in sorted((out / "hf").glob("*.safetensors")) for name, value in load_file(f).items()}


def test_a_checkpoint_saved_right_after_a_step_holds_that_steps_weights(tmp_path) -> None:
    overlapped, = run_distributed(_saved_right_after_a_step, 1, True, str(tmp_path))
    inline, = run_distributed(_saved_right_after_a_step, 1, False, str(tmp_path))
    assert overlapped.keys() == inline.keys() and inline
    for name, value in inline.items():
        assert torch.equal(overlapped[name], value), name
