"""Plans: the record of memory decisions (plan.py), the cost model and the search."""

from hf_elixir.plan.plan import ChunkPlan, ElixirPlan, PlanError, detect_fetch_units

__all__ = ["ChunkPlan", "ElixirPlan", "PlanError", "detect_fetch_units"]
