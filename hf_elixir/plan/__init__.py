"""Plans: the record of memory decisions (plan.py), the cost model (cost.py), the search.

``hf_elixir.plan`` is both this package and the planning entry point: calling the package,
``hfe.plan(model, batch, ...)``, runs ``hf_elixir.plan.search.plan``. A plain function of
the same name exported from ``hf_elixir`` would hide the package (``import
hf_elixir.plan.search`` would then fail), so the package itself is made callable.
"""

import sys
import types

from hf_elixir.plan.plan import ChunkPlan, ElixirPlan, PlanError, detect_fetch_units


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs) -> ElixirPlan:
        from hf_elixir.plan.search import plan

        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["ChunkPlan", "ElixirPlan", "PlanError", "detect_fetch_units"]
