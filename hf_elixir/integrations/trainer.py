"""ElixirTrainingArguments and ElixirTrainer: the Transformers Trainer on the hf_elixir runtime.

A Trainer user adds ``--elixir`` (and optionally ``--elixir_config '{...}'``); under
``hf-elixir launch`` (``ACCELERATE_USE_ELIXIR=true``) nothing at all. The Trainer then builds
an ElixirAccelerator, so the model is sharded by ``accelerator.prepare``; checkpoints hold
the sharded state (``elixir_state/``: fp32 master weights, optimizer state, param_groups and
loss scaler) next to the Trainer's own files (scheduler, RNG states, trainer state, and what
``save_model`` writes), and resuming works at any world size.

A PEFT model (``PeftModel``) trains the same way: its frozen base is sharded in frozen chunks,
``save_model`` writes the adapter folder ``PeftModel.from_pretrained`` loads (PEFT's own
``save_pretrained``, fed the gathered state), and checkpoints store the adapters' state only.

The private Trainer methods overridden here are listed in ``overrides.py``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from transformers import Trainer, TrainingArguments

from hf_elixir import checkpoint
from hf_elixir.integrations.accelerate import ELIXIR_STATE_DIR, ElixirAccelerator, state_to_save
from hf_elixir.integrations.planning import batch_shape_from_inputs, unsupported_optimizer_message
from hf_elixir.optimizers import trainer_names
from hf_elixir.integrations.lazy import LazyElixirModule
from hf_elixir.integrations.microbatch import TrainerSplitter, split_inputs
from hf_elixir.integrations.throughput import ThroughputCallback
from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin, elixir_requested
from hf_elixir.runtime import ElixirModule

SCHEDULER_FILE = "scheduler.pt"  # the Trainer's own name for the LR scheduler state
SUPPORTED_OPTIMS = trainer_names()  # the optimizer table's (hf_elixir/optimizers.py)


@dataclass
class ElixirTrainingArguments(TrainingArguments):
    """TrainingArguments with ``elixir`` and ``elixir_config``.

    ``elixir`` is also switched on by ``ACCELERATE_USE_ELIXIR=true`` (set by ``hf-elixir
    launch``). ``elixir_config`` is a dict, a JSON object or the path of a JSON file with
    ElixirPlugin options; unset options come from ``ELIXIR_*`` environment variables.
    Every option is checked here, before any model is touched.
    """

    elixir: bool = field(default=False, metadata={"help": "Shard the model with hf_elixir (planned automatically)."})
    elixir_config: Optional[Union[dict, str]] = field(
        default=None,
        metadata={"help": "hf_elixir options as a JSON object or a JSON file path, e.g. "
                          "'{\"gpu_memory\": \"24GiB\", \"offload\": \"auto\"}'."},
    )

    def __post_init__(self) -> None:
        if not self.elixir and elixir_requested():
            self.elixir = True
        self.elixir_plugin: Optional[ElixirPlugin] = None
        if self.elixir:
            self.elixir_plugin = ElixirPlugin.from_json(self.elixir_config)
            if self.deepspeed:
                raise ElixirConfigError("--elixir and --deepspeed both shard the model; use one of them")
            if self.fsdp:
                raise ElixirConfigError("--elixir and --fsdp both shard the model; use one of them")
            optim = str(getattr(self.optim, "value", self.optim))
            if optim not in SUPPORTED_OPTIMS:
                raise ElixirConfigError(unsupported_optimizer_message(f"--optim {optim}"))
        elif self.elixir_config is not None:
            raise ElixirConfigError("--elixir_config is set but hf_elixir is off; add --elixir")
        super().__post_init__()

    @property
    def place_model_on_device(self) -> Optional[bool]:
        # The model is sharded onto the device by accelerator.prepare, never moved whole first.
        return False if self.elixir else super().place_model_on_device


def _plugin_for(args: Any) -> Optional[ElixirPlugin]:
    if isinstance(args, ElixirTrainingArguments):
        return args.elixir_plugin
    return ElixirPlugin() if elixir_requested() else None


class ElixirTrainer(Trainer):
    """A Trainer whose accelerator is an ElixirAccelerator when hf_elixir is on."""

    def __init__(self, model=None, args=None, *rest: Any, **kwargs: Any) -> None:
        self._elixir_plugin = _plugin_for(args)
        super().__init__(model, args, *rest, **kwargs)
        if self.is_elixir:
            self.throughput = ThroughputCallback(plan_of=self._running_plan, tokens_per_step=self._tokens_per_step,
                                                 time_report_of=self._time_report)
            self.add_callback(self.throughput)

    def _running_plan(self):
        module = self._elixir_module()
        return module.plan if module is not None else None

    def _time_report(self) -> Optional[dict]:
        module = self._elixir_module()
        return module.time_report() if module is not None else None

    def _tokens_per_step(self) -> int:
        """Tokens one optimizer step consumes on every rank: the shape of the first training
        batch, or, when it was not known at prepare, the plan's searched micro-batch x
        sequence times its split; 0 when neither is known."""
        batch, seq = getattr(self.accelerator, "_elixir_batch_shape", None) or (0, 0)
        if not (batch and seq):
            plan = self._running_plan()
            batch = plan.predictions.get("batch_size", 0) * plan.micro_batch_split
            seq = plan.predictions.get("seq_len", 0)
        return batch * seq * self.args.world_size * self.args.gradient_accumulation_steps

    @property
    def is_elixir(self) -> bool:
        return self._elixir_plugin is not None

    def create_accelerator_and_postprocess(self) -> None:
        if not self.is_elixir:
            return super().create_accelerator_and_postprocess()
        # The Trainer builds its accelerator by name inside this method; point the name at
        # ElixirAccelerator for the call, keeping every argument the Trainer computes.
        import transformers.trainer as trainer_module

        original = trainer_module.Accelerator
        trainer_module.Accelerator = functools.partial(ElixirAccelerator, elixir_plugin=self._elixir_plugin)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            trainer_module.Accelerator = original

    # ------------------------------------------------------------------ training
    def train(self, *args: Any, **kwargs: Any):
        """``Trainer.train``; with ``auto_find_batch_size`` under hf_elixir, the batch is found
        the hf_elixir way: a batch the planner finds too large runs as smaller micro-batches
        (``planning.plan_split``), and a step that runs out of memory later is re-planned and
        redone (runtime/recovery.py), the micro-batch being one of the levers. The global
        batch, the LR schedule and the data order stay the script's. The Trainer's own search
        (halve the batch, rebuild the loop, wrap the model again) is not used: it changes the
        global batch and cannot re-wrap a sharded model."""
        if not (self.is_elixir and self.args.auto_find_batch_size):
            return super().train(*args, **kwargs)
        self.accelerator.elixir_split_batches = True
        self.args.auto_find_batch_size = False
        try:
            return super().train(*args, **kwargs)
        finally:
            self.args.auto_find_batch_size = True

    def training_step(self, model, inputs, num_items_in_batch=None):
        """``Trainer.training_step``, once per micro-batch of the plan's ``micro_batch_split``
        (integrations/microbatch.py), with the loss divided by that many times the
        accumulation. A micro-batch whose step failed (out of memory) reports 0 here; its
        redone loss is added to the logged loss after the step (``_maybe_log_save_evaluate``)."""
        split = self._micro_batch_split(inputs)
        if split <= 1:
            return self._one_training_step(model, inputs, num_items_in_batch)
        parts = split_inputs(inputs, split)
        accumulation = self.current_gradient_accumulation_steps
        self.current_gradient_accumulation_steps = accumulation * len(parts)
        try:
            return sum(self._one_training_step(model, part, num_items_in_batch) for part in parts)
        finally:
            self.current_gradient_accumulation_steps = accumulation

    def _one_training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        emodel = self._elixir_module()
        if emodel is not None and emodel.recovery.last_forward_stood_in():  # sharded by training_step
            return torch.zeros_like(loss)
        return loss

    def _micro_batch_split(self, inputs) -> int:
        """The running plan's split (sharding a lazily planned model first, for this batch),
        with the Trainer's splitter handed to the runtime for a recovery's redo."""
        emodel = self._elixir_module()
        if emodel is None:
            return 1
        if isinstance(emodel, LazyElixirModule) and not emodel.sharded:
            emodel.shard(batch_shape_from_inputs((), dict(inputs)))
        if emodel.recovery.splitter is None:
            emodel.recovery.splitter = TrainerSplitter(lambda: self.args.per_device_train_batch_size)
        return emodel.plan.micro_batch_split

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args: Any, **kwargs: Any) -> None:
        """The Trainer's logging, with a recovered step's figures: the loss its redo computed
        for the micro-batches that had reported 0, and the norm its clip measured after the
        redo (the clip returned NaN while the step was failed)."""
        emodel = self._elixir_module()
        if emodel is not None:  # a training step ran: a lazily planned model is sharded
            owed, norm = emodel.recovery.take_redone()
            if owed is not None:
                tr_loss += owed.to(tr_loss.device, tr_loss.dtype)
            if norm is not None:
                grad_norm = norm
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # ------------------------------------------------------------------ model access
    def _elixir_module(self) -> Optional[ElixirModule]:
        wrapped = getattr(self, "model_wrapped", None)
        return wrapped if isinstance(wrapped, ElixirModule) else None

    def _elixir_optimizer(self):
        opt = self.optimizer
        return getattr(opt, "optimizer", opt)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        emodel = self._elixir_module()
        if emodel is not None and model in (emodel, emodel.module):
            return emodel  # evaluation and later training run through the sharded wrapper
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # ------------------------------------------------------------------ saving
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """What the model's ``save_pretrained`` writes (a ``from_pretrained`` folder; for a PEFT
        model its adapter folder, without the frozen base), from weights gathered collectively
        (every process must call this), written by the main process."""
        emodel = self._elixir_module()
        if emodel is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = state_to_save(emodel)  # every process takes part
        self._save(output_dir, state_dict=state_dict)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        emodel = self._elixir_module()
        if emodel is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        checkpoint.save(emodel, self._elixir_optimizer(), Path(output_dir) / ELIXIR_STATE_DIR)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    # ------------------------------------------------------------------ resuming
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # An hf_elixir checkpoint is loaded after the model is sharded (in
        # _load_optimizer_and_scheduler); any other checkpoint loads whole, as usual.
        if self.is_elixir and _has_elixir_state(resume_from_checkpoint):
            return
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: Optional[str]) -> None:
        emodel = self._elixir_module()
        if checkpoint_dir is None or emodel is None or not _has_elixir_state(checkpoint_dir):
            return super()._load_optimizer_and_scheduler(checkpoint_dir)
        # weights, optimizer state and the param_groups' learning rates, resharded to this run
        checkpoint.load(emodel, self._elixir_optimizer(), Path(checkpoint_dir) / ELIXIR_STATE_DIR)
        sched = os.path.join(checkpoint_dir, SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    def _load_best_model(self) -> None:
        emodel = self._elixir_module()
        best = self.state.best_model_checkpoint
        if emodel is None or best is None or not _has_elixir_state(best):
            return super()._load_best_model()
        checkpoint.load(emodel, None, Path(best) / ELIXIR_STATE_DIR)


def _has_elixir_state(directory: str) -> bool:
    return (Path(directory) / ELIXIR_STATE_DIR / "elixir_index.json").is_file()
