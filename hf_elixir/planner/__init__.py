"""The planner: the plan record (record.py), the cost model (cost.py, fetches.py, traffic.py,
pricing.py), the search (search.py) and its explanation (summary.py).

The package is ``planner``; ``hf_elixir.plan(model, batch, ...)`` is its entry point (the
search), and ``ElixirPlan`` is the record it returns.
"""

from hf_elixir.planner.record import ChunkPlan, ElixirPlan, PlanError
from hf_elixir.planner.search import plan

__all__ = ["ChunkPlan", "ElixirPlan", "PlanError", "plan"]
