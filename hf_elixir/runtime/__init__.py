"""The chunk runtime: executes an ElixirPlan. Imports neither accelerate nor transformers."""

from hf_elixir.runtime.module import ElixirModule
from hf_elixir.runtime.optim import ElixirOptimizer
from hf_elixir.runtime.precision import DynamicLossScaler

__all__ = ["ElixirModule", "ElixirOptimizer", "DynamicLossScaler"]
