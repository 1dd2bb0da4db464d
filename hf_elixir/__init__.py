"""hf_elixir: automatic memory planning and a chunk-based sharded runtime for HF causal LMs.

The public face: ``plan`` (the planner's search) and the ``ElixirPlan`` it returns, the
runtime (``ElixirModule``, ``ElixirOptimizer``), hardware profiles, and, imported on first
use so that ``import hf_elixir`` needs neither accelerate nor transformers, the integration
classes. The layers behind them are described in docs/design.md.
"""

from hf_elixir.hardware import HardwareError, HardwareProfile, parse_memory
from hf_elixir.planner import ChunkPlan, ElixirPlan, PlanError, plan
from hf_elixir.profile import ModelProfile, profile_model
from hf_elixir.runtime import DynamicLossScaler, ElixirModule, ElixirOptimizer
from hf_elixir.runtime.recovery import RecoveryFailed
from hf_elixir.runtime.released import ReleasedParameterError
from hf_elixir.vocab import HfElixirError
from hf_elixir import measure  # registers the model timer with the planner (efficiency="auto")
# registers what finds a Transformers model's head and loss with the runtime (the logits in
# pieces); imports neither accelerate nor transformers until a model is wrapped
from hf_elixir.integrations import logit_pieces as _logit_pieces  # noqa: F401

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
    "HfElixirError",
    "ModelProfile",
    "PlanError",
    "RecoveryFailed",
    "ReleasedParameterError",
    "parse_memory",
    "plan",
    "profile_model",
    "__version__",
]
