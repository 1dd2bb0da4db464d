"""The optimizer table (hf_elixir/optimizers.py) is the one place that names an optimizer.

- an ``ast`` scan: no other module of the package spells an optimizer's name (a string
  equal to a table or Trainer name) or one of its torch classes;
- the disk tier and the planner agree on a disk chunk's bytes for every optimizer (the tier
  used to reserve two state planes while the planner priced SGD at one);
- what reads the table lists all of it: ``plan --optimizer``, the Trainer's ``optim``
  names, the message for an optimizer outside it;
- Adagrad, added through the table (a row, its kernel in runtime/update.py), trains on two
  gloo ranks, half its state on the host, as plain PyTorch trains on the whole batch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hf_elixir as hfe
from equivalence import assert_matches, elixir_run, reference_run
from harness import run_distributed
from loops import elixir_steps, plain_steps
from hf_elixir import checkpoint as ck
from hf_elixir import cli, optimizers
from hf_elixir.planner import disk as planner_disk
from hf_elixir.runtime.disk_tier import prepare
from tiny_models import make_batch, make_model

PACKAGE = Path(hfe.__file__).resolve().parent
TABLE_MODULE = PACKAGE / "optimizers.py"
#: modules that build an optimizer as any training script does (not a description of one)
USERS = {PACKAGE / "cli" / "demo.py": "the demo's training loop builds its AdamW like a user's script"}


def _names() -> set[str]:
    return {n.lower() for s in optimizers.TABLE.values() for n in (s.name, *s.trainer_names)}


def _classes() -> set[str]:
    return {q.rsplit(".", 1)[1] for s in optimizers.TABLE.values() for q in s.classes}


def naming(path: Path) -> list[str]:
    """Where ``path`` names an optimizer: a string equal to a name of the table (or a
    Trainer ``optim`` value), or one of the table's torch classes (attribute, name, import)."""
    names, classes = _names(), _classes()
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        hit = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in names:
            hit = repr(node.value)
        elif isinstance(node, ast.Attribute) and node.attr in classes:
            hit = f".{node.attr}"
        elif isinstance(node, ast.Name) and node.id in classes:
            hit = node.id
        elif isinstance(node, ast.ImportFrom) and any(a.name in classes for a in node.names):
            hit = f"from {node.module} import {', '.join(a.name for a in node.names)}"
        if hit:
            out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {hit}")
    return out


def test_no_module_outside_the_table_names_an_optimizer() -> None:
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != TABLE_MODULE and path not in USERS
             for line in naming(path)]
    assert not found, "optimizer names outside hf_elixir/optimizers.py (read the table instead):\n" + "\n".join(found)


def test_the_scan_sees_a_name(tmp_path) -> None:
    """The scan is not blind: the old spellings are caught."""
    sample = PACKAGE / "_scan_sample.py"
    sample.write_text('import torch\nx = "sgd"\ny = torch.optim.AdamW\nfrom torch.optim import SGD\n')
    try:
        assert len(naming(sample)) == 3
    finally:
        sample.unlink()


@pytest.mark.parametrize("optimizer", optimizers.OPTIMIZERS)
def test_disk_tier_and_planner_price_a_disk_chunk_alike(optimizer, tmp_path) -> None:
    """A bf16 plan (the master has a plane of its own) with every chunk on disk: the bytes per
    element the runtime's tier lays out are the planner's (the free-disk checks agree)."""
    model = make_model("llama")
    plan = hfe.ElixirPlan.simple(model, 1, chunk_size=4096, offload_fraction=1.0, compute_dtype="bf16")
    for chunk in plan.chunks:
        chunk.optim_placement = "disk"
    laid_out = prepare(plan, model, 1, torch.device("cpu"), tmp_path)
    for chunk in laid_out.chunks:
        # each plane holds one fp32 per element (padded to the I/O alignment)
        assert len(chunk.planes) * 4 == planner_disk.bytes_per_element(optimizer), (optimizer, chunk.planes)
    assert len(optimizers.spec(optimizer).state) <= optimizers.MAX_STATE_PLANES


def test_plan_offers_every_optimizer_of_the_table() -> None:
    actions = [a for a in _walk_actions(cli.build_parser()) if "--optimizer" in a.option_strings]
    assert actions and all(tuple(a.choices) == optimizers.OPTIMIZERS for a in actions)
    assert "adagrad" in actions[0].choices


def _walk_actions(parser):
    import argparse

    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _walk_actions(sub)


def test_trainer_takes_every_table_name_and_the_message_lists_them(tmp_path) -> None:
    from hf_elixir.integrations.plugin import ElixirConfigError
    from hf_elixir.integrations.trainer import ElixirTrainingArguments

    for name in optimizers.trainer_names():
        ElixirTrainingArguments(output_dir=str(tmp_path), elixir=True, optim=name)
    with pytest.raises(ElixirConfigError) as info:
        ElixirTrainingArguments(output_dir=str(tmp_path), elixir=True, optim="adafactor")
    for spec in optimizers.TABLE.values():
        assert spec.label in str(info.value)
    for name in optimizers.trainer_names():
        assert name in str(info.value)


def test_a_torch_optimizer_outside_the_table_is_refused_with_the_table() -> None:
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096))
    with pytest.raises(TypeError) as info:
        hfe.ElixirOptimizer(em, torch.optim.RMSprop(model.parameters()))
    assert "RMSprop" in str(info.value) and all(s.label in str(info.value) for s in optimizers.TABLE.values())


def test_adagrad_with_a_starting_sum_is_refused_before_anything_changes() -> None:
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, 1, chunk_size=4096))
    with pytest.raises(optimizers.OptimizerError, match="initial_accumulator_value=0"):
        hfe.ElixirOptimizer(em, torch.optim.Adagrad(model.parameters(), initial_accumulator_value=0.1))


def _adagrad(rank: int, world_size: int) -> dict:
    return elixir_run(rank, world_size, "llama", dict(chunk_size=4096, rcache_blocks=3, offload_fraction=0.5),
                      opt_kind="adagrad")


def test_adagrad_on_two_ranks_matches_pytorch() -> None:
    """Half the chunks' state on the host (updated behind the next forward), runs of
    neighbouring parameters merged, an LR schedule, lr_decay and clipping: plain
    torch.optim.Adagrad on the whole batch in one process gives the same losses and weights
    (equivalence.py's tolerance). Adagrad's first step moves every element by about lr
    whatever its gradient's size, so an element whose gradient is rounding noise may move
    either way: the recipe keeps lr at Adam's 3e-3 (at 0.05 such elements alone put the
    weights 1e-4 apart, on one rank as on two)."""
    got = run_distributed(_adagrad, 2)
    ref = reference_run("llama", opt_kind="adagrad")
    assert_matches(ref, got[0], label="adagrad")
    assert got[0]["losses"] == got[1]["losses"]
    # the device chunks' sums (one fp32 per element), a shard of each on each rank
    held = [r["memory"]["current"].get("optimizer_state", 0) for r in got]
    assert held[0] == held[1] > 0


def _adagrad_state(rank: int, world_size: int) -> dict:
    model = make_model("llama")
    em = hfe.ElixirModule(model, hfe.ElixirPlan.simple(model, world_size, chunk_size=4096, offload_fraction=0.5))
    eopt = hfe.ElixirOptimizer(em, torch.optim.Adagrad(model.parameters(), lr=1e-2, lr_decay=0.1))
    ids = make_batch(4, 16)[rank * 2 : rank * 2 + 2]

    def train(steps):  # each rank's own losses
        return elixir_steps(em, eopt, [ids] * steps, average=False)

    train(2)
    model_state, opt_state = em.state_dict(), eopt.state_dict()
    continued = train(2)
    em.load_state_dict(model_state)
    eopt.load_state_dict(opt_state)
    resumed = train(2)
    return {"continued": continued, "resumed": resumed, "opt_state": opt_state if rank == 0 else None,
            "inner_state": len(eopt.inner.state)}


def test_adagrad_state_dict_is_torchs_and_resumes() -> None:
    """Adagrad built over the wrapped model (torch fills its sums at construction: a
    released parameter answers with a zero-stride tensor, and ElixirOptimizer drops the
    inner optimizer's whole-parameter state); its sharded sums come back as
    torch.optim.Adagrad's own state_dict (keys, step counts and values of the plain
    optimizer after the same two steps), and loading it resumes the run exactly."""
    got = run_distributed(_adagrad_state, 2)[0]
    assert got["continued"] == got["resumed"]
    assert got["inner_state"] == 0
    model = make_model("llama")
    torch_opt = torch.optim.Adagrad(model.parameters(), lr=1e-2, lr_decay=0.1)
    plain_steps(model, torch_opt, [make_batch(4, 16)] * 2)
    want, have = torch_opt.state_dict(), got["opt_state"]
    assert set(have["state"]) == set(want["state"])
    for idx, entry in want["state"].items():
        assert set(have["state"][idx]) == set(entry) == {"step", "sum"}
        assert float(have["state"][idx]["step"]) == float(entry["step"]) == 2.0
        diff = (have["state"][idx]["sum"] - entry["sum"]).norm()
        assert diff <= 1e-5 * entry["sum"].norm() + 1e-12, idx


def _adagrad_saved(rank: int, world_size: int, ckdir: str) -> dict:
    from ckpt_common import Run

    run = Run(rank, world_size, arch="llama", plan_kwargs=dict(chunk_size=4096, offload_fraction=0.5),
              opt_kind="adagrad")
    run.steps(2)
    ck.save(run.emodel, run.eopt, ckdir, scheduler=run.sched)
    return run.steps(3)


def _adagrad_resumed(rank: int, world_size: int, ckdir: str) -> dict:
    from ckpt_common import Run

    run = Run(rank, world_size, arch="llama", plan_kwargs=dict(chunk_size=6000, offload_fraction=1.0),
              opt_kind="adagrad", seed=2)
    info = ck.load(run.emodel, run.eopt, ckdir, scheduler=run.sched)
    return {**run.steps(3), "resharded": info["resharded"]}


def test_adagrad_checkpoint_saved_at_two_ranks_resumes_at_one_and_three(tmp_path) -> None:
    """The table's state names reach the checkpoint: Adagrad's sums and steps saved at world
    size 2 and resharded to 1 and 3 ranks (another chunk size, all state on the host) go on
    with the uninterrupted run's losses."""
    ckdir = str(tmp_path / "ck")
    want = run_distributed(_adagrad_saved, 2, ckdir)[0]
    with safe_open(str(Path(ckdir) / "optimizer-rank-00000-of-00002.safetensors"), "pt") as f:
        assert {k.rsplit("/", 1)[1] for k in f.keys()} == {"sum", "step"}
    for world in (1, 3):
        got = run_distributed(_adagrad_resumed, world, ckdir)[0]
        assert got["resharded"] and got["lrs"] == want["lrs"]
        for a, b in zip(want["losses"], got["losses"]):
            assert abs(a - b) <= 1e-6 * abs(a), (world, want["losses"], got["losses"])


def test_adagrad_on_the_disk_tier_equals_the_host_tier(tmp_path) -> None:
    """Adagrad keeps one state tensor; the tier reserves the table's most planes per chunk
    and uses one: half the chunks on disk give the host tier's weights and sums, bit for bit."""
    out = []
    for disk in (False, True):
        model = make_model("llama")
        plan = hfe.ElixirPlan.simple(model, 1, chunk_size=4096, offload_fraction=1.0, compute_dtype="bf16")
        if disk:
            for chunk in [c for c in plan.chunks if not c.frozen][::2]:
                chunk.optim_placement = "disk"
        emodel = hfe.ElixirModule(model, plan, nvme_path=str(tmp_path))
        opt = hfe.ElixirOptimizer(emodel, torch.optim.Adagrad(model.parameters(), lr=1e-2))
        if disk:
            assert emodel.disk is not None and emodel.disk.state_names == ("sum",)
        elixir_steps(emodel, opt, [make_batch(2, 16)] * 3, clip=1.0)
        out.append((emodel.state_dict(), opt.state_dict()))
        emodel.close()
    for key, value in out[0][0].items():
        assert torch.equal(value, out[1][0][key]), key
    for idx, entry in out[0][1]["state"].items():
        assert torch.equal(entry["sum"], out[1][1]["state"][idx]["sum"]), idx
    assert list(tmp_path.iterdir()) == []


def test_stock_trainer_with_optim_adagrad_under_launch_equals_plain_ddp(tmp_path) -> None:
    """A Trainer name the table added: the unmodified Trainer script with --optim adagrad
    under ``hf-elixir launch`` (2 processes, CPU) against plain ``accelerate launch`` (DDP)."""
    import yaml

    from hf_elixir.integrations.launch import accelerate_view, default_config, read_config, write_config
    from hf_elixir.integrations.plugin import ElixirPlugin
    from harness import free_port
    from integration_helpers import accelerate_launch, elixir_launch, max_diff, trainer_args

    write_config(tmp_path / "elixir.yaml", default_config(2, use_gpu=False), ElixirPlugin(plan="auto"))
    plain_config, _ = accelerate_view(read_config(tmp_path / "elixir.yaml"), cuda=False)
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(plain_config))
    # eps 1e-6, as the recipe's Adam: GPT-2's key bias has a gradient of pure rounding noise
    # (softmax ignores a shift), which Adagrad's default 1e-10 would turn into steps of +-lr
    args = [*trainer_args(optim="adagrad", save_strategy="no", eval_strategy="no"), "--optim_args", "eps=1e-6"]
    accelerate_launch(tmp_path / "plain.yaml", free_port(), "trainer_run.py", "--output_dir", str(tmp_path / "p"),
                      "--result", str(tmp_path / "plain.pt"), *args, cwd=tmp_path)
    elixir_launch(tmp_path / "elixir.yaml", free_port(), "trainer_run.py", "--output_dir", str(tmp_path / "e"),
                  "--result", str(tmp_path / "elixir.pt"), *args, cwd=tmp_path)
    plain, elixir = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "elixir.pt")
    assert elixir["is_elixir"] and not plain["is_elixir"]
    assert elixir["global_step"] == plain["global_step"] == 6
    assert max_diff(elixir["state"], plain["state"]) < 2e-5
