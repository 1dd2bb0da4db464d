"""Fine-tune a causal LM (GPT-2 by default) with the Transformers Trainer on hf_elixir.

    hf-elixir launch --config_file examples/accelerate_configs/elixir.yaml \
        examples/finetune_gpt2_trainer.py --model_name_or_path gpt2 \
        --train_file my_text.txt --output_dir out/gpt2-ft --num_train_epochs 1

``--lora_r 8`` fine-tunes LoRA adapters (PEFT, ``pip install -e .[peft]``) over the frozen
pretrained weights instead of every weight: hf_elixir shards the frozen base like the rest,
and the output folder is a PEFT adapter that ``PeftModel.from_pretrained`` loads onto the
base model (the script checks that it does).

``--load_in_4bit true`` with ``--lora_r`` is QLoRA (``pip install -e ".[qlora]"``): the base is
quantised to 4 bits as it loads (bitsandbytes ``BitsAndBytesConfig``, nf4) and prepared with
PEFT's ``prepare_model_for_kbit_training``; hf_elixir shards its packed 4-bit weights like any
frozen weight, and the adapter is checked on a freshly quantised base.

The only hf_elixir-specific lines are the two imports below: ElixirTrainingArguments adds
``--elixir`` / ``--elixir_config`` (and turns on by itself under ``hf-elixir launch``), and
ElixirTrainer shards the model with the plan the planner picks. Prints the held-out
perplexity and a greedy sample before and after training, saves the model, and checks that
``from_pretrained`` (or, for an adapter, ``PeftModel.from_pretrained`` on the base) reloads it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, default_data_collator, set_seed

from clm_data import load_text, tokenize_and_pack
from hf_elixir.integrations import ElixirTrainer, ElixirTrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="gpt2", metadata={"help": "hub id or local folder"})
    load_in_4bit: bool = field(default=False, metadata={
        "help": "QLoRA: quantise the base to 4 bits on load (bitsandbytes nf4); needs --lora_r"})


@dataclass
class DataArguments:
    dataset_name: Optional[str] = field(default=None, metadata={"help": "a `datasets` dataset name"})
    dataset_config_name: Optional[str] = None
    train_file: Optional[str] = field(default=None, metadata={"help": "a local text file"})
    validation_file: Optional[str] = None
    validation_split_percentage: int = 5
    block_size: int = 128
    prompt: str = field(default="The", metadata={"help": "prompt of the greedy samples"})
    sample_tokens: int = 40


@dataclass
class LoraArguments:
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 (default) fine-tunes every weight"})
    lora_alpha: Optional[float] = field(default=None, metadata={"help": "LoRA scale numerator (default 2 x rank)"})
    lora_dropout: float = 0.0
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "comma-separated module names to adapt, or all-linear (every linear layer "
                          "but the output head)"})


QLORA_INSTALL = 'pip install -e ".[qlora]"'


def load_base(model_args: ModelArguments):
    """The pretrained model, quantised to 4 bits on load for QLoRA: the 4-bit layers compute
    in bf16 on a GPU, in float32 on a CPU; the weights left whole (embeddings, norms) are
    float32, as ``prepare_model_for_kbit_training`` wants them."""
    if not model_args.load_in_4bit:
        return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        sys.exit(f"--load_in_4bit needs bitsandbytes and PEFT: {QLORA_INSTALL}")
    compute = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, quantization_config=quant,
                                                dtype=torch.float32)


def prepare_4bit(model):
    """PEFT's preparation of a quantised base: the whole weights in float32, input gradients
    and the model's own gradient checkpointing on (hf_elixir keeps it)."""
    try:
        from peft import prepare_model_for_kbit_training
    except ImportError:
        sys.exit(f"--load_in_4bit needs bitsandbytes and PEFT: {QLORA_INSTALL}")
    return prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})


def with_lora(model, lora: LoraArguments):
    """``model`` with LoRA adapters (PEFT) on ``lora.lora_target_modules``; the rest frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        sys.exit("--lora_r needs PEFT: pip install -e .[peft] (or pip install peft)")
    targets = lora.lora_target_modules
    config = LoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha or 2 * lora.lora_r, lora_dropout=lora.lora_dropout,
                        target_modules=targets if targets == "all-linear" else targets.split(","),
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def count(p: torch.Tensor) -> int:
    """Weights in ``p``; a packed 4-bit weight holds two a byte (its quantisation state knows
    the unpacked shape)."""
    state = getattr(p, "quant_state", None)
    return state.shape.numel() if state is not None and hasattr(state, "shape") else p.numel()


def describe_trainable(model) -> str:
    trainable = sum(count(p) for p in model.parameters() if p.requires_grad)
    total = sum(count(p) for p in model.parameters())
    return f"{trainable / 1e6:.2f}M of {total / 1e6:.2f}M parameters train ({100 * trainable / total:.1f}%)"


def reload_saved(model_args: ModelArguments, output_dir: str, lora: bool):
    """The saved result loaded the way its users will: a ``from_pretrained`` folder, or the
    pretrained base with the saved adapter on top."""
    if not lora:
        return AutoModelForCausalLM.from_pretrained(output_dir).eval()
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(model_args), output_dir).eval()
    for module in model.modules():
        # On a CPU with AVX512-bf16, bitsandbytes runs a 4-bit layer in eval mode through
        # another kernel (its weight re-packed on first use); hf_elixir keeps that off, so the
        # check compares the product the trained model computed
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def prompt_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits on the prompt (every process takes part when the model is sharded)."""
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float().cpu()


def sample(trainer, tokenizer, prompt: str, tokens: int) -> str:
    """A greedy continuation; every process takes part (the model is sharded)."""
    model = trainer.model_wrapped
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def perplexity(metrics: dict) -> float:
    return math.exp(min(metrics["eval_loss"], 50.0))


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, LoraArguments, ElixirTrainingArguments))
    model_args, data_args, lora_args, args = parser.parse_args_into_dataclasses()
    if lora_args.lora_r < 0:
        sys.exit(f"--lora_r must be 0 (full fine-tuning) or a positive rank, got {lora_args.lora_r}")
    use_lora = lora_args.lora_r > 0
    if model_args.load_in_4bit and not use_lora:
        sys.exit("--load_in_4bit trains LoRA adapters over the 4-bit base (QLoRA): give --lora_r too")
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = load_base(model_args)
    if model_args.load_in_4bit:
        model = prepare_4bit(model)
    if use_lora:
        model = with_lora(model, lora_args)
    block = min(data_args.block_size, getattr(model.config, "n_positions", data_args.block_size))
    raw = load_text(data_args.dataset_name, data_args.dataset_config_name, data_args.train_file,
                    data_args.validation_file, data_args.validation_split_percentage)
    with args.main_process_first(desc="dataset preparation"):
        data = tokenize_and_pack(raw, tokenizer, block)

    trainer = ElixirTrainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["validation"],
                            processing_class=tokenizer, data_collator=default_data_collator)
    main_process = trainer.is_world_process_zero()

    before = trainer.evaluate()
    text_before = sample(trainer, tokenizer, data_args.prompt, data_args.sample_tokens)
    if main_process:
        if use_lora:
            base = "the 4-bit pretrained weights" if model_args.load_in_4bit else "the pretrained weights"
            print(f"LoRA r={lora_args.lora_r} on {lora_args.lora_target_modules}: {describe_trainable(model)}; "
                  f"{base} stay frozen", flush=True)
        print(f"held-out perplexity before: {perplexity(before):.2f}", flush=True)
        print(f"sample before: {text_before!r}", flush=True)

    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = trainer.evaluate()
    text_after = sample(trainer, tokenizer, data_args.prompt, data_args.sample_tokens)
    ids = tokenizer(data_args.prompt, return_tensors="pt").input_ids
    trained_logits = prompt_logits(trainer.model_wrapped, ids)
    trainer.save_model(args.output_dir)  # with LoRA: the adapter only, not the frozen base
    if main_process:
        print(f"held-out perplexity after: {perplexity(after):.2f} (before: {perplexity(before):.2f})", flush=True)
        print(f"sample after: {text_after!r}", flush=True)
        reloaded = reload_saved(model_args, args.output_dir, use_lora)
        with torch.no_grad():
            again = reloaded.generate(ids, max_new_tokens=data_args.sample_tokens, do_sample=False,
                                      pad_token_id=tokenizer.eos_token_id)
        same = tokenizer.decode(again[0], skip_special_tokens=True) == text_after
        gap = (prompt_logits(reloaded, ids) - trained_logits).abs().max().item()
        loader = "PeftModel.from_pretrained on the base" if use_lora else "from_pretrained"
        if model_args.load_in_4bit:
            loader += " quantised again"
        print(f"saved to {args.output_dir}; {loader} gives the same sample: {same} "
              f"(logits within {gap:.1e})", flush=True)
        if not same:
            sys.exit("the reloaded model does not reproduce the trained model's sample")


if __name__ == "__main__":
    main()
