"""The bare-runtime example (examples/finetune_demo.py) runs under torchrun on 2 processes and trains."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_trains_checkpoints_and_exports(tmp_path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "finetune_demo.py"), "--steps", "20", "--output", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 0.5, proc.stdout
    assert "Elixir plan for GPT2LMHeadModel" in proc.stdout
    assert "from_pretrained gives the same sample: True" in proc.stdout
    assert (tmp_path / "ckpt" / "elixir_index.json").is_file()
    assert (tmp_path / "model" / "model.safetensors").is_file()
