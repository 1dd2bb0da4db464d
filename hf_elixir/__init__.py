"""hf_elixir: automatic memory planning and a chunk-based sharded runtime for HF causal LMs.

``hf_elixir.plan`` is the planning function (``hfe.plan(model, batch)``); the subpackage of
the same name stays importable as ``hf_elixir.plan.search`` and friends.
"""

from hf_elixir.hardware import HardwareError, HardwareProfile, parse_memory
from hf_elixir.plan.plan import ChunkPlan, ElixirPlan, PlanError
from hf_elixir import plan  # a callable package: hfe.plan(model, batch, ...)
from hf_elixir.profile import ModelProfile, profile_model
from hf_elixir.runtime import DynamicLossScaler, ElixirModule, ElixirOptimizer

__version__ = "0.1.0"

__all__ = [
    "ChunkPlan",
    "DynamicLossScaler",
    "ElixirModule",
    "ElixirOptimizer",
    "ElixirPlan",
    "HardwareError",
    "HardwareProfile",
    "ModelProfile",
    "PlanError",
    "parse_memory",
    "plan",
    "profile_model",
    "__version__",
]
