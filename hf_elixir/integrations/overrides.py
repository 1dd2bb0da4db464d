"""Every Accelerate and Transformers method hf_elixir overrides or relies on by name.

Public methods change rarely and keep their meaning; private ones (leading underscore) and
module-level names can change in any release, so they are listed here with the versions the
integration was checked against. ``tests/test_integration_overrides.py`` fails when an
installed release no longer has one of them, which is the moment to re-read that method.
"""

from __future__ import annotations

#: the oldest and newest releases the whole suite passed on (docs/design.md, supported versions)
CHECKED_AGAINST = {"accelerate": ("1.15.0", "1.16.0"), "transformers": ("5.17.0", "5.25.0")}

# (class path, method or attribute, why hf_elixir overrides or uses it)
OVERRIDDEN: list[tuple[str, str, str]] = [
    ("accelerate.Accelerator", "prepare", "models, optimizers, loaders, schedulers in any order; plan first"),
    ("accelerate.Accelerator", "prepare_model", "shard with ElixirModule instead of DDP/autocast"),
    ("accelerate.Accelerator", "prepare_optimizer", "wrap in ElixirOptimizer, no state moves"),
    ("accelerate.Accelerator", "prepare_scheduler", "pair the user's scheduler with the elixir optimizer"),
    ("accelerate.Accelerator", "prepare_data_loader", "remember the first batch's shape for planning"),
    ("accelerate.Accelerator", "backward", "divide by accumulation steps, fp16 loss scaling"),
    ("accelerate.Accelerator", "clip_grad_norm_", "global norm from the gradient shards"),
    ("accelerate.Accelerator", "unwrap_model", "the user's model inside ElixirModule"),
    ("accelerate.Accelerator", "get_state_dict", "full tensors gathered from the shards"),
    ("accelerate.Accelerator", "save_model", "a from_pretrained folder with config"),
    ("accelerate.Accelerator", "save_state", "sharded checkpoint beside Accelerate's own files"),
    ("accelerate.Accelerator", "load_state", "reshard the sharded checkpoint"),
    ("accelerate.Accelerator", "_models", "hidden from save_state/load_state while they run"),
    ("accelerate.Accelerator", "_optimizers", "hidden from save_state/load_state while they run"),
    ("accelerate.optimizer.AcceleratedOptimizer", "_is_overflow", "reports fp16 skipped steps"),
    ("transformers.Trainer", "create_accelerator_and_postprocess", "build an ElixirAccelerator"),
    ("transformers.Trainer", "_wrap_model", "evaluate through the sharded wrapper"),
    ("transformers.Trainer", "save_model", "gather collectively, write on the main process"),
    ("transformers.Trainer", "_save", "writes the gathered state_dict (called, not overridden)"),
    ("transformers.Trainer", "_save_optimizer_and_scheduler", "sharded checkpoint in elixir_state/"),
    ("transformers.Trainer", "_load_from_checkpoint", "defer elixir checkpoints until after sharding"),
    ("transformers.Trainer", "_load_optimizer_and_scheduler", "load and reshard elixir_state/"),
    ("transformers.Trainer", "_load_best_model", "load the best checkpoint's sharded weights"),
    ("transformers.Trainer", "training_step", "run a batch as the plan's micro-batches"),
    ("transformers.Trainer", "_maybe_log_save_evaluate", "log a recovered step's redone loss and norm"),
    ("transformers.Trainer", "train", "auto_find_batch_size: split batches instead of halving them"),
    ("transformers.TrainingArguments", "place_model_on_device", "never move the whole model first"),
]

# module-level names swapped by name (not subclass methods)
MODULE_NAMES: list[tuple[str, str, str]] = [
    ("transformers.trainer", "Accelerator", "create_accelerator_and_postprocess builds it by this name"),
    ("accelerate", "Accelerator", "hf-elixir launch's bootstrap installs ElixirAccelerator"),
    ("transformers", "Trainer", "hf-elixir launch's bootstrap installs ElixirTrainer"),
    ("transformers", "TrainingArguments", "hf-elixir launch's bootstrap installs ElixirTrainingArguments"),
]
