"""ElixirAccelerator: Accelerate's Accelerator with the hf_elixir runtime underneath.

Accelerate has no registry of distributed types, and a new ``DistributedType`` member would
make it skip its own collectives. So hf_elixir plugs in the way FSDP and DeepSpeed do: the
accelerator keeps Accelerate's distributed type (NO, MULTI_CPU, MULTI_GPU), so ``gather``,
``reduce``, ``wait_for_everyone``, RNG synchronisation and data-loader sharding are
Accelerate's own, and only what touches parameters, gradients and optimizer state is
overridden (see ``overrides.py`` for the list and the versions it was checked against).

Without a plugin (and without ``ACCELERATE_USE_ELIXIR=true``) it is a plain Accelerator.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from torch import nn
from torch.utils.data import DataLoader

from hf_elixir import checkpoint
from hf_elixir.integrations.compiling import compile_request
from hf_elixir.integrations.lazy import LazyElixirModule, NotShardedYetError
from hf_elixir.integrations.planning import (
    batch_shape_from_loader, compute_dtype, machines_from_env, make_plan, optimizer_kind,
)
from hf_elixir.integrations.plugin import ElixirConfigError, ElixirPlugin, elixir_requested, env_flag
from hf_elixir.integrations.process_exit import destroy_process_groups_at_exit
from hf_elixir.runtime import ElixirModule, ElixirOptimizer

ELIXIR_STATE_DIR = "elixir_state"  # sharded checkpoint folder inside a save_state / Trainer checkpoint


def _compile_line(emodel: ElixirModule) -> str:
    """The runtime's compile line under the plan's summary, when compile was asked for."""
    return f"\n{emodel.compiled.describe()}" if emodel.compiled.options is not None else ""


def _pieces_line(emodel: ElixirModule) -> str:
    """Under the plan's summary, when its logits run in pieces or were meant to: how they
    run, or why whole (runtime/logit_pieces.py)."""
    return f"\n{emodel.logit_pieces.note}" if emodel.plan.logit_piece_tokens > 0 else ""


def _elixir_state_dir(directory: str | os.PathLike, index: int) -> Path:
    return Path(directory) / (ELIXIR_STATE_DIR if index == 0 else f"{ELIXIR_STATE_DIR}_{index}")


class ElixirAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around an ElixirOptimizer.

    Accelerate's wrapper supplies gradient-accumulation gating (``step``/``zero_grad`` run only
    on sync steps); state is never moved (it is sharded already) and Accelerate's GradScaler is
    not used: the ElixirOptimizer scales fp16 losses itself and skips overflowing steps on
    every rank, which ``step_was_skipped`` reports to the LR scheduler and the Trainer.

    The optimizer of a model that is sharded on its first forward (``LazyElixirModule``)
    starts as the user's own optimizer (``elixir`` is None): its ``param_groups`` are the
    dicts LR schedulers drive, before and after, and ``shard`` swaps in the ElixirOptimizer
    over those same groups once the model is sharded, before its first backward.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: ElixirModule) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.elixir_module = module

    @property
    def elixir(self) -> Optional[ElixirOptimizer]:
        """The ElixirOptimizer; None while the model waits for its first forward."""
        return self.optimizer if isinstance(self.optimizer, ElixirOptimizer) else None

    def shard(self) -> None:
        if self.elixir is None:
            self.optimizer = ElixirOptimizer(self.elixir_module, self.optimizer)

    def step(self, closure=None):
        before = getattr(self.optimizer, "skipped_steps", 0)
        result = super().step(closure)
        self._is_overflow = getattr(self.optimizer, "skipped_steps", 0) > before
        return result


class ElixirAccelerator(Accelerator):
    """An Accelerator that shards prepared models with hf_elixir.

    Args:
        elixir_plugin: the options; default: ``ElixirPlugin()`` (read from ``ELIXIR_*``) when
            ``ACCELERATE_USE_ELIXIR`` is true, else hf_elixir stays off.
        *args, **kwargs: Accelerate's own arguments.
    """

    def __init__(self, *args: Any, elixir_plugin: Optional[ElixirPlugin] = None, **kwargs: Any) -> None:
        if elixir_plugin is None and elixir_requested():
            elixir_plugin = ElixirPlugin()
        if elixir_plugin is not None:
            _refuse_other_sharding(kwargs)
        super().__init__(*args, **kwargs)
        self.elixir_plugin = elixir_plugin
        self.state.elixir_plugin = elixir_plugin
        self._elixir_modules: list[ElixirModule] = []  # survives free_memory(): the Trainer re-prepares
        self._elixir_batch_shape: Optional[tuple[int, int]] = None
        self._elixir_pending_loads: list[str] = []  # load_state before a lazy model was sharded
        #: a batch that does not fit may be planned as smaller micro-batches (planning.plan_split);
        #: only a caller that runs a plan's micro_batch_split sets it (ElixirTrainer, for
        #: auto_find_batch_size): a plain loop hands the model whole batches
        self.elixir_split_batches = False
        if elixir_plugin is not None:
            self.scaler = None  # the ElixirOptimizer scales fp16 losses itself
            destroy_process_groups_at_exit()  # a normal end destroys the groups (process_exit.py)

    @property
    def is_elixir(self) -> bool:
        return self.elixir_plugin is not None

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement=None):
        """Prepare data loaders, models, optimizers and schedulers, in any order.

        Data loaders are prepared first (the plan is made for the first training batch's
        shape), then models, then optimizers (wrapping needs the sharded model), then LR
        schedulers. Everything is checked before the first model is sharded.
        """
        if not self.is_elixir:
            return super().prepare(*args, device_placement=device_placement)
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(f"`device_placement` should be a list with {len(args)} elements")
        models = [a for a in args if isinstance(a, nn.Module) and not isinstance(a, ElixirModule)]
        if len(models) + len(self._elixir_modules) > 1 and not all(
            self._find_module(m) is not None for m in models
        ):
            raise ElixirConfigError(
                "hf_elixir shards one model per Accelerator; prepare the other models with a plain "
                "Accelerator or combine them into one nn.Module"
            )
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        for opt in optimizers:
            if not isinstance(opt, (AcceleratedOptimizer, ElixirOptimizer)):
                optimizer_kind(opt)  # an unsupported optimizer fails before any sharding
        result = list(args)
        order = (
            (DataLoader, lambda o, d: self.prepare_data_loader(o, device_placement=d)),
            (nn.Module, lambda o, d: self.prepare_model(o, device_placement=d, optimizer=optimizers[0] if optimizers else None)),
            (torch.optim.Optimizer, lambda o, d: self.prepare_optimizer(o, device_placement=d)),
            (torch.optim.lr_scheduler.LRScheduler, lambda o, d: self.prepare_scheduler(o)),
        )
        for kind, prepare_one in order:
            for i, obj in enumerate(args):
                if isinstance(obj, kind):
                    result[i] = prepare_one(obj, device_placement[i])
        for item in result:
            if any(item in c for c in (self._dataloaders, self._models, self._optimizers, self._schedulers)):
                item._is_accelerate_prepared = True
        return tuple(result) if len(result) > 1 else result[0]

    def prepare_data_loader(self, data_loader: DataLoader, device_placement=None, slice_fn_for_dispatch=None):
        if self.is_elixir and self._elixir_batch_shape is None:
            self._elixir_batch_shape = batch_shape_from_loader(data_loader)
        return super().prepare_data_loader(
            data_loader, device_placement=device_placement, slice_fn_for_dispatch=slice_fn_for_dispatch
        )

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False, optimizer: Optional[torch.optim.Optimizer] = None):
        """Shard ``model`` with the plan the plugin asks for (also in evaluation mode, so that
        a model evaluated before training is the one that trains)."""
        if not self.is_elixir:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        existing = self._find_module(model)
        if existing is not None:
            if existing not in self._models:
                self._models.append(existing)
            return existing
        dtype, kind, shape = compute_dtype(self.mixed_precision), optimizer_kind(optimizer), self._planning_shape()
        plugin = self.elixir_plugin
        compiled, note = compile_request(self.state.dynamo_plugin, plugin.compile)
        if note and self.is_main_process:
            print(note, flush=True)
        if shape is None and plugin.plan == "auto" and not plugin.pinned:
            # No batch shape yet (no loader with this prepare, or one that cannot tell it
            # without being drawn from): plan on the first forward, from its real inputs.
            lazy = LazyElixirModule(
                model, lambda first: self._plan_for_first_forward(model, first, dtype),
                device=self.device, on_shard=self._on_lazy_shard, recover_oom=plugin.recover_oom,
                nvme_path=plugin.nvme_path, compile=compiled)
            self._elixir_modules.append(lazy)
            self._models.append(lazy)
            if self.is_main_process:
                print(f"hf_elixir is active on {self.num_processes} process(es) "
                      f"({self.distributed_type.value}); no training batch shape was known at prepare, "
                      "so the model is planned and sharded on its first forward", flush=True)
            return lazy
        plan = make_plan(model, plugin, world_size=self.num_processes, dtype=dtype, optimizer=kind,
                         batch_shape=shape, machines=machines_from_env(self.num_processes),
                         split_batches=self.elixir_split_batches)
        emodel = ElixirModule(model, plan, device=self.device, recover_oom=plugin.recover_oom,
                              nvme_path=plugin.nvme_path, compile=compiled)
        self._elixir_modules.append(emodel)
        self._models.append(emodel)
        if self.is_main_process:
            print(f"hf_elixir is active on {self.num_processes} process(es) "
                  f"({self.distributed_type.value}):\n{plan.summary()}{_pieces_line(emodel)}{_compile_line(emodel)}", flush=True)
        return emodel

    def _plan_for_first_forward(self, model: nn.Module, shape: tuple[int, int], dtype: str):
        """The plan of a lazily sharded model, for the shape of its first forward (the
        optimizer prepared beside it, if any, names the optimizer the plan prices)."""
        emodel = self._find_module(model)
        pending = [o.optimizer for o in self._optimizers
                   if isinstance(o, ElixirAcceleratedOptimizer) and o.elixir_module is emodel]
        p = self.elixir_plugin
        shape = (p.batch_size or shape[0], p.seq_len or shape[1])  # a pinned half of the shape wins
        self._elixir_batch_shape = shape
        return make_plan(model, self.elixir_plugin, world_size=self.num_processes, dtype=dtype,
                         optimizer=optimizer_kind(pending[0] if pending else None), batch_shape=shape,
                         machines=machines_from_env(self.num_processes), split_batches=self.elixir_split_batches)

    def _on_lazy_shard(self, emodel: "LazyElixirModule") -> None:
        """The model was just sharded (inside its first forward): give its optimizers their
        sharded state and apply a ``load_state`` that waited for it."""
        for opt in self._optimizers:
            if isinstance(opt, ElixirAcceleratedOptimizer) and opt.elixir_module is emodel:
                opt.shard()
        if self.is_main_process:
            print(f"hf_elixir sharded the model on its first forward (batch {emodel.plan.predictions.get('batch_size', '?')}"
                  f" x sequence {emodel.plan.predictions.get('seq_len', '?')}):\n{emodel.plan.summary()}{_pieces_line(emodel)}"
                  f"{_compile_line(emodel)}", flush=True)
        loads, self._elixir_pending_loads = self._elixir_pending_loads, []
        for directory in loads:
            for i, (module, opt) in enumerate(self._elixir_pairs()):
                if module is emodel:
                    checkpoint.load(module, opt, _elixir_state_dir(directory, i))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        if not self.is_elixir:
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if isinstance(optimizer, ElixirAcceleratedOptimizer):
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            return optimizer
        optimizer_kind(optimizer)
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owner = next((m for m in self._elixir_modules if params <= {id(p) for p in m.parameters()}), None)
        if owner is None:
            raise ElixirConfigError(
                "this optimizer's parameters do not belong to a model hf_elixir has prepared; prepare "
                "the model before or together with its optimizer, and build the optimizer over "
                "model.parameters()"
            )
        sharded = not isinstance(owner, LazyElixirModule) or owner.sharded
        wrapped = ElixirAcceleratedOptimizer(ElixirOptimizer(owner, optimizer) if sharded else optimizer, owner)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler):
        if not self.is_elixir:
            return super().prepare_scheduler(scheduler)
        if getattr(scheduler, "_is_accelerate_prepared", False):
            return super().prepare_scheduler(scheduler)
        # The user's scheduler drives their own optimizer's param_groups, which are the
        # ElixirOptimizer's too; pair it with the wrapper so skipped steps are honoured.
        target = getattr(scheduler, "optimizer", None)
        for opt in self._optimizers:
            inner = opt.optimizer
            if target is opt or target is inner or target is getattr(inner, "inner", None):
                prepared = AcceleratedScheduler(scheduler, opt, step_with_optimizer=self.step_scheduler_with_optimizer,
                                                split_batches=self.split_batches)
                self._schedulers.append(prepared)
                return prepared
        return super().prepare_scheduler(scheduler)

    def _planning_shape(self) -> Optional[tuple[int, int]]:
        shape = self._elixir_batch_shape
        p = self.elixir_plugin
        if p.batch_size is not None or p.seq_len is not None:
            if shape is None and (p.batch_size is None or p.seq_len is None):
                return None  # the other comes from the first forward (LazyElixirModule)
            shape = (p.batch_size or shape[0], p.seq_len or shape[1])
        return shape

    def _find_module(self, model: nn.Module) -> Optional[ElixirModule]:
        for emodel in self._elixir_modules:
            if model is emodel or model is emodel.module:
                return emodel
        return None

    def _elixir_pairs(self) -> list[tuple[ElixirModule, Optional[ElixirOptimizer]]]:
        pairs = []
        for emodel in self._elixir_modules:
            opt = next((o.elixir for o in self._optimizers
                        if isinstance(o, ElixirAcceleratedOptimizer) and o.elixir_module is emodel), None)
            pairs.append((emodel, opt))
        return pairs

    def _optimizer_for(self, parameters: list[torch.Tensor]) -> Optional[ElixirOptimizer]:
        ids = {id(p) for p in parameters}
        for emodel, opt in self._elixir_pairs():
            if opt is not None and ids and ids <= {id(p) for p in emodel.parameters()}:
                return opt
        return None

    # ------------------------------------------------------------------ training
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Divide by the accumulation steps (as Accelerate does) and scale under fp16."""
        if not self.is_elixir:
            return super().backward(loss, **kwargs)
        kwargs.pop("learning_rate", None)
        loss = loss / self.gradient_accumulation_steps
        pairs = [opt for _, opt in self._elixir_pairs() if opt is not None]
        if pairs:
            pairs[0].backward(loss, **kwargs)
        else:
            loss.backward(**kwargs)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        """The global norm of the sharded gradients, as plain PyTorch would compute it."""
        if not self.is_elixir:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        parameters = list(parameters)
        opt = self._optimizer_for(parameters)
        if opt is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return opt.clip_grad_norm_(max_norm, norm_type)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's model. Its sharded parameters cannot be read outside forward and
        backward (they raise ReleasedParameterError), so its ``save_pretrained`` needs
        ``state_dict=accelerator.get_state_dict(model)`` on every process, as PEFT's and
        Transformers' Accelerate examples pass it; or use ``save_model``."""
        if isinstance(model, ElixirModule):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model, unwrap: bool = True):
        """Full tensors under the model's own keys (collective: call on every process)."""
        emodel = model if isinstance(model, ElixirModule) else self._find_module(model)
        if emodel is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return emodel.state_dict()

    # ------------------------------------------------------------------ saving
    def save_model(self, model, save_directory: str | os.PathLike, max_shard_size="10GB",
                   safe_serialization: bool = True):
        """Write what the model's ``save_pretrained`` writes: a folder ``from_pretrained``
        loads or, for a PEFT model, the adapter folder ``PeftModel.from_pretrained`` loads onto
        its base (plain Accelerate writes a PEFT model's whole state_dict instead, base
        included). Weights are gathered on every process (a collective) and written by the
        main process."""
        emodel = model if isinstance(model, ElixirModule) else self._find_module(model)
        if emodel is None:
            return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                      safe_serialization=safe_serialization)
        state_dict = state_to_save(emodel)
        if self.is_main_process:
            os.makedirs(save_directory, exist_ok=True)
            save_pretrained_folder(emodel.module, save_directory, state_dict,
                                   max_shard_size=max_shard_size, safe_serialization=safe_serialization)
        self.wait_for_everyone()

    @contextmanager
    def _without_elixir_objects(self) -> Iterator[None]:
        """Hide sharded models and optimizers from Accelerate's own save/load, which would
        gather them whole; the sharded checkpoint holds them instead."""
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if not isinstance(m, ElixirModule)]
        self._optimizers = [o for o in optimizers if not isinstance(o, ElixirAcceleratedOptimizer)]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any):
        """Accelerate's files (schedulers, samplers, RNG states, custom objects) plus the
        sharded checkpoint of each elixir model and optimizer in ``elixir_state/``."""
        if not self.is_elixir:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        waiting = [m for m in self._elixir_modules if isinstance(m, LazyElixirModule) and not m.sharded]
        if waiting:
            raise NotShardedYetError(
                "save_state was called before the model's first forward: no training batch shape "
                "was known at prepare, so hf_elixir shards the model (and builds its optimizer state) "
                "on its first forward, and there is no sharded state to save yet. Save after a "
                "training step, or set the batch_size and seq_len elixir options to shard at prepare")
        with self._without_elixir_objects():
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        for i, (emodel, opt) in enumerate(self._elixir_pairs()):
            checkpoint.save(emodel, opt, _elixir_state_dir(location, i))
        return location

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs: Any):
        """Load what ``save_state`` wrote, at this world size and plan (it reshards)."""
        if not self.is_elixir:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            input_dir = _latest_checkpoint(os.path.join(self.project_dir, "checkpoints"))
        if input_dir is None or not os.path.isdir(os.path.expanduser(input_dir)):
            raise ValueError(f"no checkpoint folder {input_dir!r} to load")
        pairs = self._elixir_pairs()
        for i in range(len(pairs)):
            if not (_elixir_state_dir(input_dir, i) / "elixir_index.json").is_file():
                raise ValueError(
                    f"{input_dir} holds no hf_elixir state ({_elixir_state_dir(input_dir, i).name}/); "
                    "was it saved by ElixirAccelerator.save_state?"
                )
        for i, (emodel, opt) in enumerate(pairs):
            if isinstance(emodel, LazyElixirModule) and not emodel.sharded:
                # the state is resharded to the plan, which the first forward makes
                self._elixir_pending_loads.append(input_dir)
            else:
                checkpoint.load(emodel, opt, _elixir_state_dir(input_dir, i))
        with self._without_elixir_objects():
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)


def state_to_save(emodel: ElixirModule) -> dict:
    """The gathered weights ``save_pretrained`` needs (collective).

    A PEFT model writes only its adapters (and modules_to_save), which are trainable, so
    only the trainable chunks are gathered: a frozen 13B base would otherwise be copied whole
    into every rank's host memory for a few megabytes of adapter. Prompt-learning methods
    and adapters on an embedding layer (PEFT may then save the base embedding too) get the
    whole state."""
    configs = getattr(emodel.module, "peft_config", None)
    if isinstance(configs, dict) and configs:
        embedding_names = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out", "word_embeddings")
        needs_base = any(
            getattr(c, "is_prompt_learning", False)
            or any(name in str(getattr(c, "target_modules", None) or "") for name in embedding_names)
            for c in configs.values())
        if not needs_base:
            return emodel.trainable_state_dict()
    return emodel.state_dict()


def save_pretrained_folder(model: nn.Module, directory: str | os.PathLike, state_dict: dict,
                           max_shard_size="10GB", safe_serialization: bool = True) -> None:
    """Write ``state_dict`` through ``model.save_pretrained`` (a PEFT model keeps only its
    adapters' entries), or as one safetensors file for a model without it."""
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(directory, state_dict=state_dict, max_shard_size=max_shard_size,
                              safe_serialization=safe_serialization)
        return
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state_dict.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})


def _latest_checkpoint(folder: str) -> Optional[str]:
    if not os.path.isdir(folder):
        return None
    numbered = [(int(m.group(1)), f) for f in os.listdir(folder) if (m := re.search(r"(\d+)$", f))]
    return os.path.join(folder, max(numbered)[1]) if numbered else None


def _refuse_other_sharding(kwargs: dict) -> None:
    """hf_elixir replaces FSDP and DeepSpeed; enabling both is a configuration error."""
    if kwargs.get("deepspeed_plugin") is not None or kwargs.get("deepspeed_plugins") or env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise ElixirConfigError(
            "hf_elixir and DeepSpeed both shard the model; turn one off (remove the DeepSpeed "
            "config / ACCELERATE_USE_DEEPSPEED, or unset ACCELERATE_USE_ELIXIR)"
        )
    if kwargs.get("fsdp_plugin") is not None or env_flag("ACCELERATE_USE_FSDP"):
        raise ElixirConfigError(
            "hf_elixir and FSDP both shard the model; turn one off (remove the FSDP config / "
            "ACCELERATE_USE_FSDP, or unset ACCELERATE_USE_ELIXIR)"
        )
