"""hf_elixir: automatic memory planning and a chunk-based sharded runtime for HF causal LMs."""

from hf_elixir.plan.plan import ChunkPlan, ElixirPlan, PlanError
from hf_elixir.runtime import DynamicLossScaler, ElixirModule, ElixirOptimizer

__version__ = "0.1.0"

__all__ = [
    "ChunkPlan",
    "DynamicLossScaler",
    "ElixirModule",
    "ElixirOptimizer",
    "ElixirPlan",
    "PlanError",
    "__version__",
]
