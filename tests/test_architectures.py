"""Every causal-LM architecture of the installed transformers trains like plain PyTorch.

The list is read from transformers at test time, so a new release's architectures are
swept with no edit. Tiny configs come from each config class's defaults (arch_configs.py);
training and the comparison are in arch_sweep.py. Skipped, with the reason printed: what
is not a decoder-only causal LM trainable from ``input_ids``, and what plain PyTorch itself
cannot build or train.
"""

from __future__ import annotations

import functools
import time

import torch

from arch_configs import causal_lm_types
from arch_sweep import first_gradients, sweep, twin_gradients
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


# ---------------------------------------------------------------------- issue 39
ISSUE_39 = "granitemoehybrid_issue39"  # arch_configs.CASES: the issue's config, ids and packing


def _issue_39(rank: int, world_size: int) -> dict:
    """One spawned pair: the sweep's comparison of the case, then one backward's gradients."""
    return {"sweep": sweep(rank, world_size, [ISSUE_39])[ISSUE_39],
            "first": first_gradients(rank, world_size, ISSUE_39)}


@functools.lru_cache(maxsize=None)
def _issue_39_results() -> dict:
    return run_distributed(_issue_39, 2, timeout=600)[0]


def test_granitemoehybrid_of_issue_39_trains_like_plain_pytorch() -> None:
    """Issue 39's granitemoehybrid (two Mamba layers with experts) strays from the plain
    reference 18x as far as the batch split does (by the issue's measure: 1.5e-4 against
    8.6e-6, all in one weight of the token embedding), and so does its twin (plain PyTorch
    with the hooks' identity views): hf_elixir ends on the twin's weights (0.0 apart here),
    so it is rounding, not a fault. That embedding
    weight's first gradient is a cancellation, -1.87e-7 in float64 beside 8e-3 elsewhere in
    its row; float32 gets -1.97e-7 plainly and -1.83e-7 in the twin's grouping, and clipping
    (norm 6.4) leaves it 3e-8, three times AdamW's eps, where the first step's update
    g / (|g| + eps) still follows its value: the two groupings move it 1.3e-5 apart. The
    sweep's criterion, unchanged, holds: hf_elixir within FACTOR spreads of the reference and
    of its twin (whose bit-equality ``..._gradients_are_its_twins_bit_for_bit`` shows)."""
    outcome = _issue_39_results()["sweep"]
    assert outcome["status"] == "ran", outcome
    print(f"\n  {ISSUE_39}: weights (hf_elixir, spread) {outcome['weights']}, loss {outcome['loss']}, "
          f"from its twin (hf_elixir, split) {outcome['twin']}, (split, twin) from the reference "
          f"{outcome['split_twin']}, {outcome['seconds']:.0f} s")
    assert outcome["ok"], outcome


def test_granitemoehybrid_of_issue_39_gradients_are_its_twins_bit_for_bit() -> None:
    """hf_elixir's gradients after one backward (world size 2) are plain PyTorch's given the
    identity views the hooks hand modules, to the bit, for every parameter (experts
    included); without the views 25 of the 25 differ in their last bits: the twin is
    hf_elixir's own arithmetic, so what it shares with hf_elixir is rounding."""
    first = _issue_39_results()["first"]
    assert {"model.layers.0.mamba", "model.layers.0.block_sparse_moe.experts"} <= first["hooked"]
    twin = twin_gradients(ISSUE_39, first["hooked"])
    assert set(twin) == set(first["grads"])
    different = [name for name in twin if not torch.equal(twin[name], first["grads"][name])]
    assert not different, different
    plain = twin_gradients(ISSUE_39, set())
    assert any(not torch.equal(plain[name], twin[name]) for name in twin)
