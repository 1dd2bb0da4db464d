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
import torch.distributed as dist

from arch_configs import SEQ, build_tiny, causal_lm_types, make_ids
from arch_sweep import (BATCH, CLIP, LR, STEPS, _flat, _loss, _train_plain, chunk_size, first_gradients,
                        split_across, split_gradients, sweep, twin_gradients, with_input_views)
from loops import elixir_steps
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
    """One spawned pair: the sweep's comparison of the case, one backward's gradients, and
    the case trained through hf_elixir with the sweep's plan and with a plan that offloads
    nothing and caches every chunk."""
    first = first_gradients(rank, world_size, ISSUE_39)
    return {"sweep": sweep(rank, world_size, [ISSUE_39])[ISSUE_39], "first": first,
            "plans": {name: _issue_39_elixir(rank, offload, cache_all)
                      for name, (offload, cache_all) in _ISSUE_39_PLANS.items()},
            "split": {mt: _split_against_accumulated(rank, mt, first["hooked"] if mt == ISSUE_39 else set())
                      for mt in (ISSUE_39, "gpt2", "mixtral")}}


def _split_against_accumulated(rank: int, model_type: str, views: set[str]) -> dict:
    """The sweep's twin of ``model_type`` (identity views at ``views``) trained by
    ``split_across`` on the pair and, on rank 0, by one process accumulating both halves;
    each with a parameter nothing reads, whose gradient must stay unset. Rank 0 says
    whether the two ranks ended on the same bits."""
    def twin() -> torch.nn.Module:
        model = with_input_views(build_tiny(model_type), views)
        model.register_parameter("never_read", torch.nn.Parameter(torch.ones(3)))
        return model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the sweep's ranks run
    try:
        ids = make_ids(BATCH, SEQ, model_type=model_type)
        split = twin()
        losses = split_across(split, ids, rank, None, fused=True)
        flats = [torch.empty_like(_flat(split.state_dict())) for _ in range(2)]
        dist.all_gather(flats, _flat(split.state_dict()))
        if rank != 0:
            return {}
        accumulated = twin()
        return {"losses": (losses, _train_plain(accumulated, ids, splits=2, fused=True)),
                "states": (split.state_dict(), accumulated.state_dict()),
                "ranks_agree": torch.equal(*flats)}
    finally:
        torch.set_num_threads(threads)


# the sweep's plan (8 chunks, 2 rCache blocks, half the optimizer state offloaded), and one
# where fetch order and placement cannot matter: nothing offloaded, every chunk cached
_ISSUE_39_PLANS = {"sweep": (0.5, False), "resident": (0.0, True)}


def _issue_39_elixir(rank: int, offload: float, cache_all: bool) -> dict:
    """The sweep's hf_elixir training of the case (each rank on its half of the batch) with
    ``offload`` of the optimizer state on the host and the fewest rCache blocks, or every
    chunk cached: its losses (averaged over the ranks) and final weights."""
    import warnings

    import hf_elixir as hfe

    warnings.filterwarnings("ignore")
    model = build_tiny(ISSUE_39)
    plan = hfe.ElixirPlan.simple(model, world_size=2, chunk_size=chunk_size(ISSUE_39, model),
                                 offload_fraction=offload, example_batch=(BATCH // 2, SEQ))
    plan.rcache_blocks = plan.n_chunks if cache_all else plan.min_rcache_blocks
    emodel = hfe.ElixirModule(model, plan)
    eopt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW(model.parameters(), lr=LR))
    rows = make_ids(BATCH, SEQ, model_type=ISSUE_39).chunk(2)[rank]
    losses = elixir_steps(emodel, eopt, [rows] * STEPS, clip=CLIP, loss_fn=_loss)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in emodel.state_dict().items()},
            "blocks": (plan.rcache_blocks, plan.n_chunks)}


def _issue_39_model(dtype: torch.dtype) -> torch.nn.Module:
    """The case's model in ``dtype``; in float64 its experts run their eager loop (grouped_mm
    has no float64 kernel)."""
    model = build_tiny(ISSUE_39).to(dtype)
    if dtype == torch.float64:
        for module in model.modules():
            if hasattr(module, "config"):
                module.config._experts_implementation = "eager"
    return model


def _issue_39_plain(dtype: torch.dtype) -> dict:
    """Plain PyTorch's training of the case on the whole batch in ``dtype``, on one thread as
    the ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _issue_39_model(dtype)
        losses = _train_plain(model, make_ids(BATCH, SEQ, model_type=ISSUE_39), splits=1)
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "state": model.state_dict()}


def _gradient_errors(grads: dict, exact: dict) -> dict:
    """Per parameter: the largest error of ``grads`` against ``exact`` over the largest |exact|."""
    return {name: ((grads[name].double() - g).abs().max() / (g.abs().max() or 1.0)).item()
            for name, g in exact.items()}


def _issue_39_distance(run: dict, truth: dict) -> tuple[float, str]:
    """The issue's measure: the worst of the losses' relative differences and of each
    parameter's largest weight difference over max(0.02, its largest |weight|), and where."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], truth["losses"]))
    where = "loss"
    for name, w in truth["state"].items():
        d = (run["state"][name].to(w.dtype) - w).abs().max().item() / max(0.02, w.abs().max().item())
        if d > worst:
            worst, where = d, name
    return worst, where


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


def test_the_sweeps_twin_split_over_two_ranks_is_the_accumulated_twin_bit_for_bit() -> None:
    """The sweep trains the twin with a half of the batch on each rank (``split_across``), so
    that neither rank idles while the other trains it: the losses and weights are those of
    one process accumulating both halves, to the bit, on both ranks (experts, tied
    embeddings, identity views), and a parameter no half reaches keeps no gradient (AdamW's
    weight decay would otherwise have moved its ones)."""
    for model_type, got in _issue_39_results()["split"].items():
        (split_losses, accumulated_losses), (split, accumulated) = got["losses"], got["states"]
        assert split_losses == accumulated_losses, model_type
        assert split.keys() == accumulated.keys() and "never_read" in split
        moved = [k for k in split if not torch.equal(split[k], accumulated[k])]
        assert not moved, (model_type, moved)
        assert got["ranks_agree"], model_type
        assert torch.equal(split["never_read"], torch.ones(3)), model_type


def test_granitemoehybrid_of_issue_39_strays_by_rounding_not_a_fault() -> None:
    """The distance is rounding, shown without the twin. A fault the issue names (a gradient
    summed twice, an aliasing view, an expert's chunk fetched late) would put some
    parameter's gradient far off exact, or depend on the plan; neither happens.
    hf_elixir's first gradients are within float32 rounding of float64's in every parameter
    (worst 1.1e-6 of the parameter's largest gradient, plain float32 on the split batch
    1.0e-6; a gradient summed twice or missing is 1.0 off, and Adam, which hardly sees a
    gradient's scale, would hide it in the weights). It ends on the same bits whether half
    the optimizer state is offloaded and 2 of the 8 chunks are cached (the sweep's plan) or
    nothing is offloaded and every chunk stays cached. After the three steps it is no
    farther from float64 training than plain float32 PyTorch on the whole batch (the
    reference): 1.09e-4 against 1.12e-4 by the issue's measure. In the embedding weight that
    dominates that measure, [33, 0], float64 ends at 0.0389771, hf_elixir at 0.0389736 and
    the float32 reference at 0.0389869: there, the reference is the one farther from exact."""
    results = _issue_39_results()
    exact_grads = split_gradients(_issue_39_model(torch.float64),
                                  make_ids(BATCH, SEQ, model_type=ISSUE_39).chunk(2), _loss)
    got_errors = _gradient_errors(results["first"]["grads"], exact_grads)
    plain_errors = _gradient_errors(twin_gradients(ISSUE_39, set()), exact_grads)
    worst = max(got_errors, key=got_errors.get)
    print(f"\n  {ISSUE_39} first gradients from float64's: hf_elixir worst {got_errors[worst]:.2e} ({worst}), "
          f"plain float32 worst {max(plain_errors.values()):.2e}")
    assert got_errors[worst] <= 4 * max(plain_errors.values()), got_errors

    plans = results["plans"]
    sweep_run, resident = plans["sweep"], plans["resident"]
    assert sweep_run["blocks"][0] < sweep_run["blocks"][1] and resident["blocks"][0] == resident["blocks"][1]
    moved = [name for name in sweep_run["state"]
             if not torch.equal(sweep_run["state"][name], resident["state"][name])]
    assert not moved and sweep_run["losses"] == resident["losses"], moved

    exact = _issue_39_plain(torch.float64)
    got, got_where = _issue_39_distance(sweep_run, exact)
    ref, ref_where = _issue_39_distance(_issue_39_plain(torch.float32), exact)
    print(f"  {ISSUE_39} from float64 training: hf_elixir {got:.3e} ({got_where}), "
          f"plain float32 {ref:.3e} ({ref_where})")
    assert got <= 1.5 * ref, (got, got_where, ref, ref_where)
