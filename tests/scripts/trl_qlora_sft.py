"""A QLoRA SFTTrainer script as a user writes it (the test's "user script"): nothing in it
knows about hf_elixir, so the same file runs under plain ``accelerate launch`` and under
``hf-elixir launch``.

The recipe of TRL's and PEFT's QLoRA examples: the base is loaded from a folder
(``--base``), quantised on load by bitsandbytes (``BitsAndBytesConfig``: nf4, the packed
codes stored in ``--quant_storage``), prepared with ``prepare_model_for_kbit_training``
(gradient checkpointing, input gradients, the non-quantised weights in float32), and
handed to ``SFTTrainer`` with a ``LoraConfig`` as ``peft_config``; TRL makes the PEFT model
(and, for a quantised base, casts the adapter weights to bf16). The 4-bit layers compute
in float32 (``bnb_4bit_compute_dtype``), so the comparison with DDP is about the runtime,
not about how bf16 rounds a product split over ranks. Training options come from the
command line as ``SFTConfig`` fields. After training it saves the adapter to
``<output_dir>/final`` with ``trainer.save_model`` and rank 0 writes what the test
compares to ``--result``: the log history, the state dict ``get_state_dict`` gives, and
what ran it.

``--adapter_dtype float32`` (a user's choice, applied the same way under either launcher)
puts the adapters back in float32 after TRL cast them to bf16, as PEFT's own
``autocast_adapter_dtype`` would have left them. Under plain DDP that is the arithmetic
hf_elixir uses for the stock script: the runtime holds every weight in its compute dtype
(float32 here) with a float32 master, so TRL's bf16 adapters are trained in float32 and
saved back in bf16, where DDP trains them in bf16 throughout.
"""

import os
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from peft import LoraConfig, prepare_model_for_kbit_training
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, BitsAndBytesConfig, HfArgumentParser, PreTrainedTokenizerFast,
                          TrainerCallback)
from trl import SFTConfig, SFTTrainer

VOCAB = 96
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")


@dataclass
class ScriptArguments:
    base: str = field(metadata={"help": "a from_pretrained folder of the (unquantised) base model"})
    quant_storage: str = field(default="uint8", metadata={"help": "bnb_4bit_quant_storage: uint8 or bfloat16"})
    adapter_dtype: str = field(default="", metadata={"help": "float32: keep the adapters in float32 (what PEFT's "
                                                            "autocast_adapter_dtype gives), not TRL's bf16"})
    result: str = field(default="result.pt")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Words t0..t95 map to ids 0..95; t0 pads, t1 ends a text, t2 is unknown."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def build_texts(n: int, seed: int) -> Dataset:
    """Texts of 6 to 20 words, so batches are padded and the loss masks the padding."""
    g = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(n):
        length = int(torch.randint(6, 21, (), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        texts.append(" ".join(f"t{i}" for i in ids))
    return Dataset.from_dict({"text": texts})


def load_base(folder: str, storage: str):
    """The base quantised on load (the test reloads adapters onto a fresh one of these)."""
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_quant_storage=getattr(torch, storage))
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=torch.float32,
                                                attn_implementation="eager")


def is_4bit_layer(module: torch.nn.Module) -> bool:
    """bitsandbytes' own 4-bit linear layer (PEFT's LoRA wrapper of it shares its class name)."""
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


class StepsRun(TrainerCallback):
    """The optimizer steps this process ran (a resumed run starts after its checkpoint's)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses()
    model = prepare_model_for_kbit_training(load_base(script.base, script.quant_storage),
                                            use_gradient_checkpointing=args.gradient_checkpointing)
    peft_config = LoraConfig(**LORA)
    trainer = SFTTrainer(model=model, args=args, train_dataset=build_texts(16, 1), processing_class=build_tokenizer(),
                         peft_config=peft_config)
    if script.adapter_dtype:
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.to(getattr(torch, script.adapter_dtype))
    steps_run = StepsRun()
    trainer.add_callback(steps_run)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)

    wrapped = trainer.model_wrapped
    plan = getattr(wrapped, "plan", None)
    inner = trainer.accelerator.unwrap_model(wrapped)
    embed_hooks = inner.get_input_embeddings()._forward_hooks.values()
    run_info = {
        "is_elixir": bool(getattr(trainer.accelerator, "is_elixir", False)),
        "trainer_mro": [c.__name__ for c in type(trainer).__mro__],
        "wrapped": type(wrapped).__name__,
        "world": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step,
        "steps_run": steps_run.steps,
        "chunks": None if plan is None else len(plan.chunks),
        "packed_chunks": sum(bool(getattr(c, "packed", False)) for c in getattr(wrapped, "chunks", [])),
        "rcache_blocks": None if plan is None else plan.rcache_blocks,
        "evictions": wrapped.memory_report()["cache_stats"]["evictions"] if plan is not None else None,
        # what prepare_model_for_kbit_training set up: checkpointing and input gradients
        "checkpointing": bool(getattr(inner.base_model.model, "is_activation_checkpointing",
                                      inner.base_model.model.is_gradient_checkpointing)),
        "input_grads": any(getattr(h, "__name__", "") == "make_inputs_require_grads" for h in embed_hooks),
        "adapter_dtypes": sorted({str(p.dtype) for p in inner.parameters() if p.requires_grad}),
        "quantised_layers": sum(is_4bit_layer(m) for m in inner.modules()),
    }
    state = trainer.accelerator.get_state_dict(wrapped)  # every rank takes part
    if trainer.is_world_process_zero():
        torch.save({**run_info, "log_history": trainer.state.log_history, "state": state, "final": final},
                   script.result)


if __name__ == "__main__":
    main()
