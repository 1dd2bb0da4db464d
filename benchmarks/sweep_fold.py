"""Folded profiling against tracing every layer, for every causal-LM architecture.

    python benchmarks/sweep_fold.py               # every architecture (about 20 minutes on 2 cores)
    python benchmarks/sweep_fold.py llama mixtral # some

Each architecture's tiny config (``tests/arch_configs.py``, the architecture sweep's) is made
``DEPTH`` layers deep and profiled twice on the meta device: folded (``profile.fold``: traced
3 and 4 layers deep and unfolded, or traced whole when a check fails) and with every layer
traced (``fold=False``). The two profiles must be equal in every field the planner reads; the
script records, per architecture, whether they are, whether it folded, and both times.
``profile.fold.MIN_LAYERS`` is lowered to ``DEPTH`` so that tiny configs fold at all.

Results: benchmarks/results/sweep_fold.json (``mismatches`` must be empty).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from arch_configs import causal_lm_types, deep_tiny_config, not_plainly_trainable  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from hf_elixir.profile import fold  # noqa: E402
from hf_elixir.profile.profiler import profile_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "sweep_fold.json"
DEPTH = 5
BATCH = (1, 16)


def one(model_type: str) -> dict:
    if "ConditionalGeneration" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]:
        return {"skipped": "multimodal"}
    reason = not_plainly_trainable(model_type)
    if reason:
        return {"skipped": reason}
    try:
        config = deep_tiny_config(model_type, DEPTH)
    except Exception as e:  # the architecture sweep reports these too
        return {"skipped": f"does not build: {type(e).__name__}"}
    if config is None:
        return {"skipped": "its depth cannot be set"}
    t0 = time.perf_counter()
    try:
        full = profile_model(config, BATCH, dtype="float32", fold=False)
    except Exception as e:
        return {"skipped": f"does not profile: {type(e).__name__}: {str(e)[:100]}"}
    t1 = time.perf_counter()
    folded = profile_model(config, BATCH, dtype="float32")
    t2 = time.perf_counter()
    return {"same": fold.same_profile(full, folded), "folded": "traced_layers" in folded.extra,
            "every_layer_s": round(t1 - t0, 3), "folded_s": round(t2 - t1, 3)}


def main() -> None:
    fold.MIN_LAYERS = DEPTH
    types = sys.argv[1:] or causal_lm_types()
    rows = {}
    for model_type in types:
        rows[model_type] = one(model_type)
        print(model_type, rows[model_type], flush=True)
    profiled = {k: v for k, v in rows.items() if "same" in v}
    summary = {
        "depth": DEPTH, "batch": BATCH, "architectures": len(rows), "profiled": len(profiled),
        "folded": sorted(k for k, v in profiled.items() if v["folded"]),
        "traced_whole": sorted(k for k, v in profiled.items() if not v["folded"]),
        "mismatches": sorted(k for k, v in profiled.items() if not v["same"]),
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=1))
    print(f"{len(profiled)} profiled, {len(summary['folded'])} folded, mismatches: {summary['mismatches']}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
