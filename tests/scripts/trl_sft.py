"""A TRL SFTTrainer script as a user writes it (the test's "user script"): nothing in it
knows about hf_elixir, so the same file runs under plain ``accelerate launch`` and under
``hf-elixir launch``.

It fine-tunes a tiny model built from a config (``--arch gpt2``: tied LM head; ``--arch
llama``: untied, as in Llama/Mistral checkpoints), in full or with a LoRA adapter
(``--lora``, SFTTrainer's ``peft_config``), on a small text dataset tokenized by a word-level
tokenizer built here (no model hub). Training options come from the command line as
``SFTConfig`` fields. After training it evaluates once, saves the model (or the adapter) to
``<output_dir>/final`` and rank 0 writes what the test compares to ``--result``.

SFTTrainer computes its loss with TRL's fused LM head, which reads
``get_output_embeddings().weight`` without calling the head module. ``probe_fused_head``
counts those kernel calls and notes whether the weight was a released hf_elixir parameter
when the kernel got it: that is test instrumentation, not something a user writes, and it
only observes (it never changes what the kernel computes).
"""

import os
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, GPT2Config, HfArgumentParser, LlamaConfig,
                          PreTrainedTokenizerFast)
from trl import SFTConfig, SFTTrainer

VOCAB = 96


@dataclass
class ScriptArguments:
    arch: str = field(default="gpt2", metadata={"help": "gpt2 (tied LM head) or llama (untied)"})
    lora: bool = field(default=False, metadata={"help": "train a LoRA adapter instead of every weight"})
    result: str = field(default="result.pt")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Words t0..t95 map to ids 0..95; t0 pads, t1 ends a text, t2 is unknown."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def build_model(arch: str) -> torch.nn.Module:
    """The same initial weights on every rank and in every run (seeded)."""
    if arch == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                            bos_token_id=1, eos_token_id=1, pad_token_id=0)
    elif arch == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    else:
        raise SystemExit(f"--arch {arch}: use gpt2 or llama")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def build_texts(n: int, seed: int) -> Dataset:
    """Texts of 6 to 20 words, so batches are padded and the loss masks the padding."""
    g = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(n):
        length = int(torch.randint(6, 21, (), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        texts.append(" ".join(f"t{i}" for i in ids))
    return Dataset.from_dict({"text": texts})


def probe_fused_head(record: dict) -> None:
    """Observe TRL's chunked log-prob kernel (see the module docstring)."""
    import trl.trainer.utils as trl_utils

    kernel = trl_utils._ChunkedLogProbFunction

    class Observed(kernel):
        @staticmethod
        def forward(ctx, hidden, weight, *rest):
            record["calls"] += 1
            record["grad_calls"] += int(hidden.requires_grad)  # a training pass, not evaluation
            # the class name only: reading the weight here would itself gather it
            record["released_at_call"] += int(type(weight).__name__.startswith("Released"))
            record["weight_shapes"].add(tuple(weight.shape))
            return kernel.forward(ctx, hidden, weight, *rest)

    trl_utils._ChunkedLogProbFunction = Observed


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses()
    probe = {"calls": 0, "grad_calls": 0, "released_at_call": 0, "weight_shapes": set()}
    probe_fused_head(probe)

    peft_config = None
    if script.lora:
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=build_model(script.arch), args=args, train_dataset=build_texts(16, 1),
                         eval_dataset=build_texts(8, 2), processing_class=build_tokenizer(),
                         peft_config=peft_config)
    trainer.train()
    metrics = trainer.evaluate()
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)

    wrapped = trainer.model_wrapped
    plan = getattr(wrapped, "plan", None)
    run_info = {
        "is_elixir": bool(getattr(trainer.accelerator, "is_elixir", False)),
        "trainer_mro": [c.__name__ for c in type(trainer).__mro__],
        "wrapped": type(wrapped).__name__,
        "world": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step,
        "chunks": None if plan is None else len(plan.chunks),
        "rcache_blocks": None if plan is None else plan.rcache_blocks,
    }
    state = trainer.accelerator.get_state_dict(wrapped)  # every rank takes part
    if trainer.is_world_process_zero():
        torch.save({**run_info, "log_history": trainer.state.log_history, "eval": metrics, "state": state,
                    "final": final, "probe": probe}, script.result)


if __name__ == "__main__":
    main()
