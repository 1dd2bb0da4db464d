"""Issue 61, part 1: a block's saved activations in host memory (``ElixirPlan.block_policies``).

- At world size 2, a 4-layer Llama at sequence 2,048 with every block ``recompute_offload``
  trains 10 steps to the losses and weights of the same plan with plain checkpointing
  (``recompute``), bit for bit, while the runtime's ledger never holds more than two
  blocks' saved inputs on the device (of four).
- ``offload`` (no recompute) and a mix of all four policies train bit for bit as ``keep``,
  and as plain PyTorch within the equivalence suite's tolerance.
- With the CUDA stream API replaced by stand-ins, the copies go where the design says: out
  after the kernels that made them, back one block ahead of the backward, the compute
  stream ordered after each copy before it reads or frees, the host never waiting.
- Bad input (a block the model does not have) fails before the model is touched; a second
  backward through freed activations says why; a dropped graph gives its bytes back; a new
  plan puts each block's own checkpointing back.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import hf_elixir as hfe
from equivalence import assert_matches, make_optimizer
from harness import run_distributed
from hf_elixir.runtime.activation_offload import LEDGER_CATEGORY, ActivationOffloader
from hf_elixir.runtime.ledger import MemoryLedger
from loops import elixir_steps, plain_steps

LAYERS, HIDDEN, LONG_SEQ, LONG_STEPS = 4, 16, 2048, 10


def long_llama(layers: int = LAYERS, seed: int = 0) -> torch.nn.Module:
    """A Llama small enough for sequence 2,048 on a shared CPU (SDPA: attention is the cost)."""
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=layers,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=LONG_SEQ,
                            vocab_size=96, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def blocks(n: int = LAYERS) -> list[str]:
    return [f"model.layers.{i}" for i in range(n)]


def with_policies(plan: hfe.ElixirPlan, policies: list[str]) -> hfe.ElixirPlan:
    return dataclasses.replace(plan, block_policies=dict(zip(blocks(len(policies)), policies)))


def ids_of(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))


def train(policies: list[str] | None, world_size: int, rows: torch.Tensor, steps: int) -> dict:
    """``steps`` steps of the equivalence recipe on ``rows`` (this rank's) under a plan whose
    blocks take ``policies`` (None: no block_policies)."""
    model = long_llama(len(policies) if policies else LAYERS)
    opt, sched = make_optimizer(model)
    plan = hfe.ElixirPlan.simple(model, world_size, chunk_size=4096)
    if policies:
        plan = with_policies(plan, policies)
    emodel = hfe.ElixirModule(model, plan)
    eopt = hfe.ElixirOptimizer(emodel, opt)
    losses = elixir_steps(emodel, eopt, [rows] * steps, clip=1.0, scheduler=sched)
    report = emodel.memory_report()
    return {"losses": losses, "state": emodel.state_dict(), "offload": report["activation_offload"],
            "ledger_peak": report["peak"].get(LEDGER_CATEGORY), "ledger_now": report["current"].get(LEDGER_CATEGORY)}


# ---------------------------------------------------------------------- acceptance 1
def _long_context(rank: int, world_size: int) -> dict:
    rows = ids_of(world_size, LONG_SEQ)[rank : rank + 1]
    plain = train(["recompute"] * LAYERS, world_size, rows, LONG_STEPS)
    offloaded = train(["recompute_offload"] * LAYERS, world_size, rows, LONG_STEPS)
    return {"plain": plain, "offloaded": offloaded}


def test_offloaded_inputs_train_as_checkpointing_bit_for_bit_with_two_blocks_on_the_device() -> None:
    for rank, got in enumerate(run_distributed(_long_context, 2)):
        plain, offloaded = got["plain"], got["offloaded"]
        assert offloaded["losses"] == plain["losses"], f"rank {rank}"
        for key, want in plain["state"].items():
            assert torch.equal(offloaded["state"][key], want), f"rank {rank}: {key}"
        counts = offloaded["offload"]
        # every block's input went to the host each step and came back ahead of its
        # recompute; the last block's never left (its backward comes first)
        assert counts["copies_out"] == LAYERS * LONG_STEPS
        assert counts["prefetched_groups"] == counts["copies_in"] == (LAYERS - 1) * LONG_STEPS
        assert counts["waited_groups"] == 0, "each block's input was prefetched before its backward"
        # at most two blocks' saved inputs on the device at any time, not all four
        one_block = LONG_SEQ * HIDDEN * 4  # this rank's one sequence of fp32 hidden states
        assert counts["peak_blocks_on_device"] == 2
        assert offloaded["ledger_peak"] == 2 * one_block
        assert counts["blocks_on_device"] == 0 and offloaded["ledger_now"] == 0
        # the host held all four at the forward's end, and holds none after the backward
        assert counts["peak_host_bytes"] == LAYERS * one_block and counts["host_bytes"] == 0
        assert plain["offload"]["copies_out"] == 0 and plain["ledger_peak"] == 0


# ---------------------------------------------------------------------- offload, keep, mixed
@pytest.fixture(scope="module")
def kept() -> dict:
    return train(["keep"] * LAYERS, 1, ids_of(2, 64), 3)


@pytest.mark.parametrize("policies", [["offload"] * LAYERS, ["offload", "keep", "recompute_offload", "recompute"]],
                         ids=["offload", "mixed"])
def test_offload_trains_as_keep_bit_for_bit(kept: dict, policies: list[str]) -> None:
    got = train(policies, 1, ids_of(2, 64), 3)
    assert got["losses"] == kept["losses"]
    for key, want in kept["state"].items():
        assert torch.equal(got["state"][key], want), key
    offloading = sum(p in ("offload", "recompute_offload") for p in policies)
    assert got["offload"]["copies_out"] > 0 and got["offload"]["waited_groups"] == 0
    assert got["offload"]["peak_blocks_on_device"] == min(2, offloading)
    assert got["ledger_now"] == 0


def test_offload_matches_plain_pytorch() -> None:
    """The independent reference: the same recipe in plain PyTorch, no hf_elixir."""
    rows = ids_of(2, 64)
    model = long_llama()
    opt, sched = make_optimizer(model)
    ref = {"losses": plain_steps(model, opt, [rows] * 3, clip=1.0, scheduler=sched),
           "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    assert_matches(ref, train(["offload"] * LAYERS, 1, rows, 3), label="offload")


# ---------------------------------------------------------------------- the copies' order
class _Event:
    def __init__(self, log: list, n: int) -> None:
        self.n = n
        self.log = log

    def synchronize(self) -> None:
        self.log.append(("host_waits", self.n))


class _Stream:
    """A CUDA stream stand-in that logs the calls that order work."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.events = log, name, 0

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append((f"{self.name}_waits_{other.name}",))

    def wait_event(self, event: _Event) -> None:
        self.log.append((f"{self.name}_waits_event", event.n))

    def record_event(self) -> _Event:
        self.events += 1
        self.log.append((f"{self.name}_records", self.events))
        return _Event(self.log, self.events)

    def synchronize(self) -> None:
        self.log.append(("host_waits", self.name))


def test_copies_are_ordered_on_streams_one_block_ahead(monkeypatch) -> None:
    log: list = []
    compute, copies = _Stream(log, "compute"), _Stream(log, "copy")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    ledger = MemoryLedger()
    offloader = ActivationOffloader(torch.device("cpu"), ledger, copy_stream=copies)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)

    def layer_fn(i):
        def run(h):
            log.append(("runs", i))
            return torch.tanh(layers[i](h))
        return run

    h = x
    for i in range(3):
        with offloader.block(f"b{i}"):
            h = torch.utils.checkpoint.checkpoint(layer_fn(i), h, use_reentrant=False)
        log.append(("closed", i, ledger.current[LEDGER_CATEGORY] // (4 * 8 * 4)))
    log.append(("backward",))
    h.sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    r = ref_x
    for i in range(3):
        r = torch.tanh(layers[i](r))
    r.sum().backward()
    assert torch.equal(x.grad, ref_x.grad)

    # forward: each block's input goes out after the kernels that made it (the copy stream
    # waits for the compute stream), and leaves the device once the next block is over
    forward = log[: log.index(("backward",))]
    assert forward == [
        ("runs", 0), ("copy_waits_compute",), ("copy_records", 1), ("closed", 0, 1),
        ("runs", 1), ("copy_waits_compute",), ("copy_records", 2), ("compute_waits_event", 1), ("closed", 1, 1),
        ("runs", 2), ("copy_waits_compute",), ("copy_records", 3), ("compute_waits_event", 2), ("closed", 2, 1),
    ]
    # backward: block 2's input is still there (the compute stream waits for its copy out
    # before it can go); block 1's comes up before block 2 recomputes, block 0's before
    # block 1 recomputes; each is waited for on the device before it is read
    backward = log[log.index(("backward",)) + 1 :]
    assert backward == [
        ("compute_waits_event", 3), ("copy_waits_compute",), ("copy_records", 4), ("runs", 2),
        ("compute_waits_event", 4), ("copy_waits_compute",), ("copy_records", 5), ("runs", 1),
        ("compute_waits_event", 5), ("runs", 0),
    ]
    assert not [e for e in log if e[0] == "host_waits"], "the host never waits for a copy"
    assert ledger.current[LEDGER_CATEGORY] == 0 and offloader.peak_blocks_on_device == 2


# ---------------------------------------------------------------------- errors and life cycle
def test_a_block_the_model_lacks_fails_before_the_model_changes() -> None:
    model = long_llama(2)
    plan = hfe.ElixirPlan.simple(model, 1, chunk_size=4096)
    bad = dataclasses.replace(plan, block_policies={"model.layers.7": "offload"})
    where = model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(hfe.PlanError, match=r"model.layers.7.*not a checkpointable block.*model.layers.0"):
        hfe.ElixirModule(model, bad)
    assert not getattr(model, "_hf_elixir_wrapped", False)
    assert not model.model.layers[0].gradient_checkpointing and model.model.embed_tokens.weight.data_ptr() == where


def test_second_backward_through_freed_activations_says_why() -> None:
    model = long_llama(2)
    emodel = hfe.ElixirModule(model, with_policies(hfe.ElixirPlan.simple(model, 1, chunk_size=4096), ["offload"] * 2))
    ids = ids_of(1, 16)
    loss = emodel(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"model.layers.\d.*freed.*retain_graph=True.*'keep' or 'recompute'"):
        loss.backward()


def test_a_dropped_graph_returns_its_bytes_and_a_new_plan_restores_the_blocks() -> None:
    model = long_llama(2)
    plan = hfe.ElixirPlan.simple(model, 1, chunk_size=4096)
    # recovery keeps the model's loss (and its graph) until the step: none here
    emodel = hfe.ElixirModule(model, with_policies(plan, ["recompute_offload", "offload"]), recover_oom=False)
    ids = ids_of(1, 16)
    loss = emodel(input_ids=ids, labels=ids).loss
    assert emodel.memory_report()["current"][LEDGER_CATEGORY] > 0
    del loss  # no backward: the graph and the copies it held go
    report = emodel.memory_report()
    assert report["current"][LEDGER_CATEGORY] == 0 and report["activation_offload"]["blocks_on_device"] == 0
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing
    emodel.adopt_plan(plan)  # no block_policies, no checkpointing: the model's own switch, off
    assert not layer.gradient_checkpointing
    emodel.adopt_plan(with_policies(plan, ["keep", "offload"]))
    assert not layer.gradient_checkpointing and model.model.layers[1].gradient_checkpointing


def test_a_backward_that_raised_leaves_no_activations_behind() -> None:
    """The end-of-backward callback never runs for a backward that raised: the next forward
    settles what that backward used, and the next backward ends with nothing on the device."""
    model = long_llama(2)
    plan = with_policies(hfe.ElixirPlan.simple(model, 1, chunk_size=4096), ["recompute_offload"] * 2)
    emodel = hfe.ElixirModule(model, plan, recover_oom=False)
    fail = [True]

    def boom(grad):
        if fail[0]:
            raise RuntimeError("injected")
        return grad

    model.model.embed_tokens.register_forward_hook(lambda m, a, out: [out.register_hook(boom), None][1])
    ids = ids_of(1, 16)
    loss = emodel(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="injected"):
        loss.backward()
    fail[0] = False
    loss = emodel(input_ids=ids, labels=ids).loss
    loss.backward()
    report = emodel.memory_report()  # the graph is still alive: only the callback frees
    assert report["current"][LEDGER_CATEGORY] == 0 and report["activation_offload"]["blocks_on_device"] == 0
    assert report["activation_offload"]["host_bytes"] == 0
