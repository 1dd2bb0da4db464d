"""Pre-runtime profiling on the meta device: fetch order (trace.py), memory (memory.py) and
the LoRA fine-tune of a model built on meta for planning (lora.py)."""

from hf_elixir.profile.lora import default_lora_targets, meta_lora_model
from hf_elixir.profile.memory import LiveStorageTracker, SDPAKernelMode, StepMemory, run_step
from hf_elixir.profile.profiler import (
    ModelProfile,
    ParamInfo,
    PassProfile,
    enable_checkpointing,
    measure_real_step,
    profile_model,
)
from hf_elixir.profile.trace import (
    ExecutionTracer,
    Trace,
    build_meta_model,
    make_batch,
    module_parameters,
    tied_parameters,
)

__all__ = [
    "ExecutionTracer",
    "LiveStorageTracker",
    "ModelProfile",
    "ParamInfo",
    "PassProfile",
    "SDPAKernelMode",
    "StepMemory",
    "Trace",
    "build_meta_model",
    "default_lora_targets",
    "enable_checkpointing",
    "make_batch",
    "measure_real_step",
    "meta_lora_model",
    "module_parameters",
    "profile_model",
    "run_step",
    "tied_parameters",
]
