"""A Trainer script with standard imports only (the test's "user script").

Fine-tunes a tiny GPT-2 on fixed random tokens with evaluation, gradient accumulation,
clipping and checkpoints (all from the command line, run_clm style); rank 0 then writes the
final weights, the eval losses, logits on a fixed input and whether hf_elixir was active to
``--result``, and saves a from_pretrained folder to ``<output_dir>/final``.
"""

import os
from dataclasses import dataclass, field

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments


@dataclass
class RunArguments:
    result: str = field(default="result.pt")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, 96, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    run, args = HfArgumentParser((RunArguments, TrainingArguments)).parse_args_into_dataclasses()
    marker = os.environ.get("TEST_STARTED_MARKER")
    if marker:
        open(marker, "a").close()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(48, 1), eval_dataset=Tokens(8, 2))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    probe = torch.arange(16).reshape(1, 16) % 96
    wrapped = trainer.model_wrapped
    wrapped.eval()
    with torch.no_grad():
        logits = wrapped(input_ids=probe).logits.float()
    state = trainer.accelerator.get_state_dict(wrapped)
    if trainer.is_world_process_zero():
        torch.save({"state": state, "evals": evals, "logits": logits, "final": final,
                    "is_elixir": bool(getattr(trainer.accelerator, "is_elixir", False)),
                    "trainer": type(trainer).__name__, "world": trainer.accelerator.num_processes,
                    "global_step": trainer.state.global_step, "log_history": trainer.state.log_history},
                   run.result)


if __name__ == "__main__":
    main()
