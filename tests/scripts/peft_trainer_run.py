"""A LoRA fine-tuning script written the way PEFT's own examples are (the tests' "user script").

It loads a base causal LM with ``from_pretrained``, wraps it with ``get_peft_model`` and
trains it with the Transformers ``Trainer`` (gradient accumulation, clipping, evaluation and
``save_steps`` checkpoints from the command line), then saves the adapter with
``trainer.save_model``. Nothing here names hf_elixir unless ``--elixir`` is given, which
parses ``ElixirTrainingArguments`` (``--elixir``, ``--elixir_config``) and builds
``ElixirTrainer`` explicitly, the way a user opts in without ``hf-elixir launch``.

Rank 0 writes to ``--result``: the per-step training losses, the eval losses, the steps this
process ran, the full state_dict after training (PEFT's key names), logits on a fixed input
from the trained model, and what ran it (trainer and accelerator class, world size); when
the model was sharded, also the runtime's memory report and the frozen bytes and padding of
its plan.
"""

import os
import sys
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments,
                          set_seed)


@dataclass
class RunArguments:
    base: str = field(metadata={"help": "a from_pretrained folder of the base model"})
    target_modules: str = field(default="c_attn", metadata={"help": "comma-separated LoRA targets"})
    result: str = field(default="result.pt")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int, seed: int) -> None:
        self.ids = torch.randint(0, vocab, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepsRun(TrainerCallback):
    """The optimizer steps this process ran (a resumed run starts after its checkpoint's)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def sharding_facts(wrapped) -> dict:
    """What the runtime reports about frozen memory, read through its public attributes
    (absent under plain DDP, where the model is not sharded)."""
    report = getattr(wrapped, "memory_report", None)
    if report is None:
        return {}
    frozen = [c for c in wrapped.chunks if c.frozen]
    itemsize = wrapped.dtype.itemsize
    return {
        "memory": report(),
        "frozen_bytes": sum(p.numel() * p.element_size() for p in wrapped.module.parameters() if not p.requires_grad),
        "frozen_padding": sum((c.size - sum(s.numel for s in c.slots)) * itemsize for c in frozen),
        "n_frozen_chunks": len(frozen),
    }


def main() -> None:
    trainer_cls, args_cls = Trainer, TrainingArguments
    if "--elixir" in sys.argv:
        from hf_elixir.integrations import ElixirTrainer, ElixirTrainingArguments

        trainer_cls, args_cls = ElixirTrainer, ElixirTrainingArguments
    run, args = HfArgumentParser((RunArguments, args_cls)).parse_args_into_dataclasses()
    set_seed(0)
    base = AutoModelForCausalLM.from_pretrained(run.base)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=run.target_modules.split(","),
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    vocab = model.config.vocab_size
    trainer = trainer_cls(model=model, args=args, train_dataset=Tokens(32, vocab, 1),
                          eval_dataset=Tokens(8, vocab, 2))
    steps_run = StepsRun()
    trainer.add_callback(steps_run)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)

    logs = trainer.state.log_history
    wrapped = trainer.model_wrapped
    wrapped.eval()
    probe = torch.arange(16).reshape(1, 16) % vocab
    with torch.no_grad():
        logits = wrapped(input_ids=probe).logits.float()
    state = trainer.accelerator.get_state_dict(wrapped)
    facts = sharding_facts(wrapped)
    if trainer.is_world_process_zero():
        torch.save({"losses": [h["loss"] for h in logs if "loss" in h],
                    "evals": [h["eval_loss"] for h in logs if "eval_loss" in h],
                    "state": state, "logits": logits, "final": final,
                    "trainer": type(trainer).__name__, "accelerator": type(trainer.accelerator).__name__,
                    "is_elixir": bool(getattr(trainer.accelerator, "is_elixir", False)),
                    "world": trainer.accelerator.num_processes, "global_step": trainer.state.global_step,
                    "steps_run": steps_run.steps,
                    **facts}, run.result)


if __name__ == "__main__":
    main()
