"""Issue 37, point 4: `hf-elixir demo --qlora` pre-trains a small Llama-style base, fine-tunes
LoRA adapters over it quantised to 4 bits on load (bitsandbytes nf4) with the Trainer under
`hf-elixir launch` (2 processes on the CPU), and reloads the adapter onto a freshly
quantised base with PeftModel.from_pretrained; without bitsandbytes or PEFT it stops at
once, naming the pip command."""

from __future__ import annotations

import re
import sys

import pytest
from safetensors import safe_open

import bitsandbytes  # noqa: F401  (in the test extra: a missing one fails here, never skips)
from demo_helpers import ADAPTED_PERPLEXITY, assert_not_degenerate, demo_cache, perplexities, sample_after
from integration_helpers import check, hf_elixir, run, worker_env


def test_demo_qlora_fast_trains_an_adapter_over_a_4bit_base_that_peft_reloads(tmp_path, tmp_path_factory) -> None:
    cache = demo_cache(tmp_path_factory)
    proc = check(hf_elixir("demo", "--fast", "--qlora", "--output", str(tmp_path / "out"),
                           "--cache-dir", str(cache), cwd=tmp_path, timeout=600))
    out = proc.stdout
    assert "No model hub here: pre-training a small Llama-style model once" in out or "(cached)" in out
    assert "quantised to 4 bits on load (nf4)" in out
    assert "hf_elixir is active on 2 process(es)" in out
    assert "frozen weights:" in out  # the planner's summary accounts for the frozen 4-bit base
    assert re.search(r"LoRA r=8 on all-linear: [\d.]+M of [\d.]+M parameters train \([\d.]+%\); "
                     r"the 4-bit pretrained weights stay frozen", out)
    before, after = perplexities(out)
    assert after < 0.5 * before and after < ADAPTED_PERPLEXITY, out[-3000:]
    assert_not_degenerate(sample_after(out))
    check_line = re.search(r"PeftModel.from_pretrained on the base quantised again gives the same sample: (\w+) "
                           r"\(logits within ([\d.e+-]+)\)", out)
    assert check_line and check_line.group(1) == "True" and float(check_line.group(2)) <= 1e-5, out[-3000:]
    adapter = tmp_path / "out" / "adapter"
    assert f"the LoRA adapter is in {adapter}" in out and "BitsAndBytesConfig(load_in_4bit=True" in out
    assert not list(adapter.glob("model*.safetensors"))  # the base is not copied next to the adapter
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)
    base = next(cache.glob("llama-small-demo-*"))
    assert (base / "tokenizer.json").is_file() and '"LlamaForCausalLM"' in (base / "config.json").read_text()


@pytest.mark.parametrize("missing", ["bitsandbytes", "peft"])
def test_demo_qlora_without_its_extra_names_the_pip_command(tmp_path, missing) -> None:
    """`import bitsandbytes` (or `import peft`) fails: the demo stops before any work."""
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            "from hf_elixir.cli import main\n"
            f"sys.exit(main(['demo', '--fast', '--qlora', '--output', {str(tmp_path / 'out')!r}, "
            f"'--cache-dir', {str(tmp_path / 'cache')!r}]))")
    proc = run([sys.executable, "-c", code], tmp_path, worker_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'pip install -e ".[qlora]"' in proc.stderr and "--qlora" in proc.stderr and missing in proc.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()
