"""Acceptance 5: `hf-elixir demo --fast` (the README's main job, in its CI mode) fine-tunes the
pretrained stand-in with the Trainer under `hf-elixir launch` and the held-out perplexity falls."""

from __future__ import annotations

import re

from demo_helpers import ADAPTED_PERPLEXITY, assert_not_degenerate, demo_cache, perplexities, sample_after
from integration_helpers import check, hf_elixir


def test_demo_fast_mode_lowers_held_out_perplexity(tmp_path, tmp_path_factory) -> None:
    cache = demo_cache(tmp_path_factory)  # shared with the --lora demo test: one pre-training
    proc = check(hf_elixir("demo", "--fast", "--output", str(tmp_path / "out"), "--cache-dir", str(cache),
                           cwd=tmp_path, timeout=600))
    out = proc.stdout
    assert "No model hub here: pre-training a small GPT-2 once" in out or "(cached)" in out
    assert "hf_elixir is active on 2 process(es)" in out and "Elixir plan for" in out
    # --fast calibrates at quick sizes where nothing current is cached (the first demo test)
    assert all("quickly" in line for line in out.splitlines() if line.startswith("calibrating this machine"))
    before, after = perplexities(out)
    assert after < 0.5 * before and after < ADAPTED_PERPLEXITY, out[-3000:]
    assert_not_degenerate(sample_after(out))
    assert "from_pretrained gives the same sample: True" in out
    assert (tmp_path / "out" / "model" / "config.json").is_file()
    assert list(cache.glob("gpt2-small-demo-*/model.safetensors"))  # cached for the next run


def test_accelerate_example_fine_tunes_a_saved_model(tmp_path) -> None:
    """examples/finetune_gpt2_accelerate.py on a folder written with save_pretrained (the hub
    id path is the same from_pretrained call)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_elixir.cli.demo import DATA, EXAMPLES, train_tokenizer
    from hf_elixir.integrations.launch import default_config, write_config
    from hf_elixir.integrations.plugin import ElixirPlugin
    from harness import free_port

    tok = train_tokenizer((DATA / "logbook_train.txt").read_text(), 400)
    base = tmp_path / "base"
    tok.save_pretrained(base)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                               eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)).save_pretrained(base)
    config = write_config(tmp_path / "c.yaml", default_config(2, use_gpu=False), ElixirPlugin())
    proc = check(hf_elixir("launch", "--config_file", str(config), "--main_process_port", str(free_port()),
                           str(EXAMPLES / "finetune_gpt2_accelerate.py"), "--model_name_or_path", str(base),
                           "--train_file", str(DATA / "logbook_train.txt"),
                           "--validation_file", str(DATA / "logbook_valid.txt"), "--block_size", "32",
                           "--max_train_steps", "12", "--gradient_accumulation_steps", "2",
                           "--learning_rate", "3e-3", "--output_dir", str(tmp_path / "out"), cwd=tmp_path))
    out = proc.stdout
    assert "hf_elixir is active on 2 process(es)" in out
    before = float(re.search(r"perplexity before: ([\d.]+)", out).group(1))
    after = float(re.search(r"perplexity after: ([\d.]+)", out).group(1))
    assert after < before and (tmp_path / "out" / "model.safetensors").is_file()
