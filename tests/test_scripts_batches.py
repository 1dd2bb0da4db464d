"""Every batch structure and prepare order an ordinary Accelerate script uses trains under
`hf-elixir launch` exactly as under plain `accelerate launch` (2-process DDP over gloo).

One unmodified script (scripts/accelerate_batches.py) is fed tensor batches, TensorDataset
tuples, dicts with custom keys, a model prepared before its loader, and batches from a
generator with no loader at all. Where the loader tells the batch shape the plan is made at
`prepare`; where it cannot (model-first, generator) the model is planned and sharded on its
first forward. The tensor, tuple, dict and model-first runs train on the same rows in the
same order, so one plain run is their reference; the generator (ranks with different
sequence lengths) has its own.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from harness import free_port
from hf_elixir.integrations.launch import accelerate_view, read_config
from integration_helpers import accelerate_launch, check, elixir_launch, hf_elixir, max_diff

SCRIPT = "accelerate_batches.py"


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """The elixir config `hf-elixir config` writes and the plain one it hands Accelerate."""
    d = tmp_path_factory.mktemp("configs")
    check(hf_elixir("config", "--non-interactive", "--num_processes", "2", "--use_cpu",
                    "--config_file", str(d / "elixir.yaml"), cwd=d))
    plain, _ = accelerate_view(read_config(d / "elixir.yaml"), cuda=False)
    (d / "plain.yaml").write_text(yaml.safe_dump(plain))
    return d / "elixir.yaml", d / "plain.yaml"


@pytest.fixture(scope="module")
def plain(configs, tmp_path_factory):
    """Plain Accelerate's results: loader-fed (shared by four cases) and generator-fed."""
    d = tmp_path_factory.mktemp("plain")
    out = {}
    for kind in ("tensor", "generator"):
        accelerate_launch(configs[1], free_port(), SCRIPT, "--out", str(d / f"{kind}.pt"), "--batches", kind, cwd=d)
        out[kind] = torch.load(d / f"{kind}.pt")
        assert not out[kind]["is_elixir"]
    return out


@pytest.mark.parametrize("batches, lazy", [
    ("tensor", False), ("tuple", False), ("dict", False), ("model-first", True), ("generator", True),
])
def test_batch_structure_trains_like_plain(configs, plain, tmp_path, batches, lazy) -> None:
    extra = ["--early_save", str(tmp_path / "early")] if lazy else []
    proc = elixir_launch(configs[0], free_port(), SCRIPT, "--out", str(tmp_path / "r.pt"), "--batches", batches,
                         *extra, cwd=tmp_path)
    result = torch.load(tmp_path / "r.pt")
    reference = plain["generator" if batches == "generator" else "tensor"]
    assert result["is_elixir"]
    assert result["prepared"] == ("LazyElixirModule" if lazy else "ElixirModule")
    assert "Traceback" not in proc.stderr
    if lazy:
        # planned on the first forward, and said so; the first rank's (longer) shape wins
        assert "sharded on its first forward" in proc.stdout
        assert "hf_elixir sharded the model on its first forward (batch 2 x sequence 16)" in proc.stdout
        assert "NotShardedYetError: save_state was called before the model's first forward" in result["early_save_error"]
    else:
        assert "Elixir plan for GPT2LMHeadModel" in proc.stdout and "first forward" not in proc.stdout
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert result["norms"] == pytest.approx(reference["norms"], rel=1e-4)
    assert result["lr"] == pytest.approx(reference["lr"])  # the scheduler drove the sharded optimizer
    assert max_diff(result["state"], reference["state"]) < 2e-5
