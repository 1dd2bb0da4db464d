"""A stock Trainer script for the compile tests (standard imports only).

Trains a tiny GPT-2 or Llama-style model (``--arch``), dropout 0, on fixed random tokens with
whatever ``TrainingArguments`` the command line gives (``--torch_compile`` among them). Rank 0
writes to ``--result`` the loss of every step, the final weights, and what torch.compile did:
dynamo's counters (frames compiled, graphs, recompiles) after each optimizer step, and the
class of the model the Trainer trained.
"""

import os
from dataclasses import dataclass, field

import torch
import torch._dynamo.utils as dynamo_utils
from transformers import (GPT2Config, GPT2LMHeadModel, HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainerCallback, TrainingArguments)


@dataclass
class RunArguments:
    result: str = field(default="result.pt")
    arch: str = field(default="gpt2")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, 96, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def dynamo_counts() -> dict:
    c = dynamo_utils.counters
    return {"frames_ok": c["frames"]["ok"], "unique_graphs": c["stats"]["unique_graphs"],
            "recompiles": sum(c["recompiles"].values()) if "recompiles" in c else 0}


class Counts(TrainerCallback):
    def __init__(self) -> None:
        self.per_step = []

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(dynamo_counts())


def model_for(arch: str):
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0, use_cache=False))
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, use_cache=False))


def main() -> None:
    run, args = HfArgumentParser((RunArguments, TrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(0)
    model = model_for(run.arch)
    counts = Counts()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 1), callbacks=[counts])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    wrapped = trainer.model_wrapped
    state = trainer.accelerator.get_state_dict(wrapped)
    if trainer.is_world_process_zero():
        torch.save({"losses": losses, "state": state, "per_step": counts.per_step, "counts": dynamo_counts(),
                    "wrapped": type(wrapped).__name__, "model": type(trainer.model).__name__,
                    "is_elixir": bool(getattr(trainer.accelerator, "is_elixir", False)),
                    "world": trainer.accelerator.num_processes, "global_step": trainer.state.global_step},
                   run.result)


if __name__ == "__main__":
    main()
