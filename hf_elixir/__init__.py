"""hf_elixir: automatic memory planning and a chunk-based sharded runtime for HF causal LMs.

``hf_elixir.plan`` is the planning function (``hfe.plan(model, batch)``); the subpackage of
the same name stays importable as ``hf_elixir.plan.search`` and friends.
"""

from hf_elixir.hardware import HardwareError, HardwareProfile, parse_memory
from hf_elixir.plan.plan import ChunkPlan, ElixirPlan, PlanError
from hf_elixir import plan  # a callable package: hfe.plan(model, batch, ...)
from hf_elixir.profile import ModelProfile, profile_model
from hf_elixir.runtime import DynamicLossScaler, ElixirModule, ElixirOptimizer
from hf_elixir.runtime.released import ReleasedParameterError

__version__ = "0.1.0"

#: the integrations, imported on first use so that ``import hf_elixir`` needs neither
#: accelerate nor transformers
_INTEGRATIONS = ("ElixirAccelerator", "ElixirPlugin", "ElixirTrainer", "ElixirTrainingArguments")


def __getattr__(name: str):
    if name in _INTEGRATIONS:
        from hf_elixir import integrations

        return getattr(integrations, name)
    raise AttributeError(f"module 'hf_elixir' has no attribute {name!r}")


__all__ = [
    *_INTEGRATIONS,
    "ChunkPlan",
    "DynamicLossScaler",
    "ElixirModule",
    "ElixirOptimizer",
    "ElixirPlan",
    "HardwareError",
    "HardwareProfile",
    "ModelProfile",
    "PlanError",
    "ReleasedParameterError",
    "parse_memory",
    "plan",
    "profile_model",
    "__version__",
]
