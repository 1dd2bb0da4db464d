"""Every causal-LM architecture of the installed transformers trains like plain PyTorch.

The list is read from transformers at test time, so a new release's architectures are
swept with no edit. Tiny configs come from each config class's defaults (arch_configs.py);
training and the comparison are in arch_sweep.py. Skipped, with the reason printed: what
is not a decoder-only causal LM trainable from ``input_ids``, and what plain PyTorch itself
cannot build or train.
"""

from __future__ import annotations

import time

from arch_configs import causal_lm_types
from arch_sweep import sweep
from harness import run_distributed


def test_every_causal_lm_architecture_trains_like_plain_pytorch() -> None:
    types = causal_lm_types()
    started = time.perf_counter()
    outcome = run_distributed(sweep, 2, types, timeout=1500)[0]
    skipped = {t: o["reason"] for t, o in outcome.items() if o["status"] == "skip"}
    failed = {t: o.get("reason") or (f"strays from plain PyTorch: weights {o['weights']}, loss {o['loss']}, "
                                     f"from its twin {o['twin']}")
              for t, o in outcome.items() if o["status"] == "fail" or (o["status"] == "ran" and not o["ok"])}
    ran = {t: o for t, o in outcome.items() if o["status"] == "ran"}
    ratio = {t: o["weights"][0] / (o["weights"][1] or float("inf")) for t, o in ran.items()}
    passed = len(types) - len(skipped) - len(failed)
    print()
    for t, reason in sorted(skipped.items()):
        print(f"  skipped {t}: {reason}")
    for t, reason in sorted(failed.items()):
        print(f"  FAILED {t}: {reason}")
    worst = sorted(ratio, key=ratio.get, reverse=True)[:5]
    print("  farthest from the reference, in plain PyTorch's spreads: "
          + ", ".join(f"{t} {ratio[t]:.1f}x" for t in worst))
    print(f"{passed}/{len(types)} architectures train like plain PyTorch ({len(skipped)} skipped) "
          f"in {time.perf_counter() - started:.0f} s")
    assert not failed, f"{len(failed)} architectures fail: {sorted(failed)}"
