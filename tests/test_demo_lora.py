"""Issue 25, acceptance 7: `hf-elixir demo --lora` fine-tunes LoRA adapters of the demo's base
model with the Trainer on hf_elixir and reloads them with PeftModel.from_pretrained; without
PEFT installed it stops at once, naming the pip command.

Issue 37: the base knows the logbook's words (it is pre-trained on prose that uses them), so
LoRA, which keeps the embeddings and the output head frozen, adapts its style: the held-out
perplexity comes near what full fine-tuning reaches and the sample is not degenerate."""

from __future__ import annotations

import re
import sys

from safetensors import safe_open

from demo_helpers import ADAPTED_PERPLEXITY, assert_not_degenerate, demo_cache, perplexities, sample_after
from integration_helpers import check, hf_elixir, run, worker_env


def test_demo_lora_fast_trains_an_adapter_that_peft_reloads(tmp_path, tmp_path_factory) -> None:
    proc = check(hf_elixir("demo", "--fast", "--lora", "--output", str(tmp_path / "out"),
                           "--cache-dir", str(demo_cache(tmp_path_factory)), cwd=tmp_path, timeout=600))
    out = proc.stdout
    assert "hf_elixir is active on 2 process(es)" in out
    assert "frozen weights:" in out  # the planner's summary accounts for the frozen base
    assert re.search(r"LoRA r=8 on all-linear: [\d.]+M of [\d.]+M parameters train", out)
    before, after = perplexities(out)
    assert after < 0.5 * before, out[-3000:]
    assert after < ADAPTED_PERPLEXITY, out[-3000:]  # within a small factor of full fine-tuning's
    assert_not_degenerate(sample_after(out))
    check_line = re.search(r"PeftModel.from_pretrained on the base gives the same sample: (\w+) "
                           r"\(logits within ([\d.e+-]+)\)", out)
    assert check_line and check_line.group(1) == "True" and float(check_line.group(2)) <= 1e-5, out[-3000:]
    adapter = tmp_path / "out" / "adapter"
    assert f"the LoRA adapter is in {adapter}" in out
    assert (adapter / "adapter_config.json").is_file()
    assert not list(adapter.glob("model*.safetensors"))  # the base is not copied next to the adapter
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)


def test_demo_lora_without_peft_names_the_pip_command(tmp_path) -> None:
    """`import peft` fails (as where it is not installed): the demo stops before any work."""
    code = ("import sys; sys.modules['peft'] = None\n"
            "from hf_elixir.cli import main\n"
            f"sys.exit(main(['demo', '--fast', '--lora', '--output', {str(tmp_path / 'out')!r}, "
            f"'--cache-dir', {str(tmp_path / 'cache')!r}]))")
    proc = run([sys.executable, "-c", code], tmp_path, worker_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pip install -e .[peft]" in proc.stderr and "--lora" in proc.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()
