"""How good are the planner's predictions? Every plan it compares, run for real.

    python benchmarks/bench_planner.py                     # three models, three budgets each
    python benchmarks/bench_planner.py --models gpt2-30m --rounds 1

For GPT-2 30M, GPT-2 124M and a Llama-style model (fp32, AdamW, clipping at 1.0, batch
2 x 128 per rank, world size 2 on CPU over gloo), and three memory budgets each, the
planner chooses a plan and names its runners-up (``plan.alternatives``); this script runs
every one of them and records, per plan:

- predicted and measured step time. The distinct plans of a model run in rounds (six by
  default), forward, then backward, then forward again..., each time in a fresh runtime for
  a few steps; the measurement is the median of all its timed steps (both ranks in
  lock-step), with the fastest beside it. This VM's speed drifts by 10-40% within minutes;
  in one pass over the plans that drift fell on whichever plans ran late and decided the
  order of near-ties, while alternating rounds spread it over every plan. A plan that is a
  candidate under several budgets is run once and its measurement shared. Plans that make
  the runtime do the same work (on a CPU device, plans that differ only in what they
  offload: the state is in host memory either way) are one *work*: each runs in the first
  round, where its memory is measured, and one of them in every later round; their steps
  are pooled and the work is one point of the rank correlation. Where a budget's
  chosen plan did not measure fastest among the plans that fit, the two run again in four
  more alternating rounds (``--duel-rounds``) and their steps join the pool, so that the
  chosen plan's measured rank rests on more than a few noisy steps.
- how far the measured order can be trusted: the Spearman correlation of the plans'
  medians over rounds 1, 4 and 5 against those over rounds 2, 3 and 6 (``spearman_split_half``),
  and from it the correlation a perfect prediction would be expected to reach against the
  whole measurement (``spearman_noise_ceiling``).
- predicted and measured peak memory per rank: the runtime's own ledger (parameter shards,
  optimizer state, gradient shards held before the step) plus everything PyTorch's CPU
  allocator hands out during one whole step (forward, backward, clipping, optimizer step),
  as the running sum of ``torch.profiler``'s memory events (the method
  ``tests/test_profile.py`` validates), plus the model's buffers;
- the measured rank of the chosen plan among the candidates that fit the budget;
- with ``--replay RESULTS_JSON``: the very plans of that earlier run, measured again in the
  same rounds, and how far the two runs' measured orders agree (``spearman_between_runs``).
  Agreement within a run can come from a disturbance that lasts the whole run (one run
  measured two copies of one Llama-60M plan 16% apart); what carries from run to run
  bounds what any prediction can reach (``ceiling_between_runs``).
- before each round, the plain model's forward and backward on both ranks (``reference_step``):
  the machine's speed then, relative to the first round.

Budgets: "roomy" fits the fastest candidate; "tight" is just above the smallest candidate's
peak; "medium" lies between them on the planner's selection chain. Each model is planned
with a calibration of this machine made just before its plans run (``hf-elixir
calibrate``, about 45 s; ``--no-calibrate`` plans with the cached one instead), and its
compute is priced at its own efficiency, timed once on two busy ranks as ``hfe.plan``
times it (``hf_elixir.measure.model_efficiency``; recorded under ``compute_efficiency``).
Results: benchmarks/results/bench_planner.json and bench_planner.png.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = (2, 128)  # per rank
WORLD = 2
CLIP = 1.0


def config_for(name: str):
    """The transformers config of each benchmarked model (dropout off: steps are comparable)."""
    from transformers import GPT2Config, LlamaConfig

    if name == "gpt2-30m":
        return GPT2Config(n_layer=6, n_embd=384, n_head=6, n_positions=1024, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    if name == "gpt2-124m":
        return GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    if name == "llama-60m":
        return LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                           max_position_embeddings=512, tie_word_embeddings=False, use_cache=False)
    raise ValueError(name)


MODELS = ("gpt2-30m", "gpt2-124m", "llama-60m")


def build(name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_for(name))
    model.config.use_cache = False
    return model


# ---------------------------------------------------------------------- planning (parent)
def budgets(cands) -> dict[str, int]:
    """Roomy, medium and tight budgets read off the planner's own selection chain."""
    from hf_elixir.planner import candidate

    path = candidate.chain(cands)
    peaks = [c.peak for c in path]
    return {"roomy": int(peaks[-1] * 1.05), "medium": int(peaks[len(peaks) // 2] * 1.01),
            "tight": int(peaks[0] * 1.01)}


def spread(profile, hw, cands, packings, budget: int, taken: set, count: int) -> list:
    """Fitting candidates spread over the predicted step times (slowest included), so the
    rank correlation is tested on plans the model tells apart, not only near-ties. Each
    adds a work not yet run (``_work``): the fitting candidate nearest its quantile
    whose work is new."""
    from hf_elixir.planner import search

    W = WORLD
    fit = sorted((c for c in cands if c.peak <= budget), key=lambda c: c.step_time)
    out = []
    for q in [(i + 1) / count for i in range(count)]:
        at = min(len(fit) - 1, int(q * (len(fit) - 1)))
        near = sorted(range(len(fit)), key=lambda i: (abs(i - at), -i))
        c = next((fit[i] for i in near if candidate_work(fit[i]) not in taken), None)
        if c is None:
            break
        taken.add(candidate_work(c))
        p = search.materialize(c, packings[c.chunk_size], profile, hw, W, profile.dtype, "adamw", budget)
        p.predictions["reason"] = f"spread: {q:.0%} of the fitting candidates are faster"
        out.append(p)
    return out


def candidates_for(name: str, hw) -> tuple:
    """One model's profile, the hardware at world size 2, every candidate the planner
    enumerates for it (with the chunk packings by chunk size), and the compute efficiency
    they are priced at: the model timed once, as ``hfe.plan`` times it, for all budgets."""
    import hf_elixir as hfe
    from hf_elixir.planner import search

    profile = hfe.profile_model(config_for(name), BATCH, dtype="float32", attention_target="cpu",
                                model_name=name)
    hw_w = search._resolve_hardware(hw, WORLD)
    efficiency = search.model_efficiency("auto", config_for(name), profile, hw_w, WORLD, profile.dtype)
    print(f"{name}: compute priced at {efficiency}", flush=True)
    cands, packings = search.enumerate_candidates(profile, hw_w, WORLD, profile.dtype, "adamw", efficiency["value"])
    return profile, hw_w, cands, packings, efficiency


def plans_for(name: str, hw, alternatives: int, spread_count: int) -> list[dict]:
    """Every (budget, plan) pair to run for one model: the chosen plan, its runners-up as
    the planner names them, and a few fitting candidates spread over predicted time."""
    import hf_elixir as hfe
    from hf_elixir.planner import search

    profile, hw_w, cands, packings, efficiency = candidates_for(name, hw)
    out = []
    for label, budget in budgets(cands).items():
        chosen = hfe.plan(config_for(name), BATCH, hardware=hw, world_size=WORLD, dtype="fp32",
                          memory_budget=budget, profile=profile, alternatives=alternatives,
                          efficiency=efficiency["value"] or "calibrated")
        chosen.predictions["compute_efficiency"] = efficiency
        alts = search.candidate_plans(chosen, profile, hw)
        taken = {candidate_work(p) for p in [chosen] + alts}
        extra = spread(profile, hw_w, cands, packings, budget, taken, spread_count)
        roles = ["chosen"] + [f"alt {i + 1}" for i in range(len(alts))] + [f"spread {i + 1}" for i in range(len(extra))]
        for role, p in zip(roles, [chosen] + alts + extra):
            out.append({"model": name, "budget": label, "budget_bytes": budget, "role": role,
                        "plan": p.to_dict()})
    return out


def replay_entries(name: str, hw, earlier: list[dict]) -> list[dict]:
    """The (budget, plan) pairs of one model from an earlier results file, rebuilt from
    their configs (the chunk layout does not depend on the calibration) and predicted with
    ``hw``. Each budget keeps the earlier run's verdict of which plans fit it."""
    from hf_elixir.planner import candidate, search

    profile, hw_w, cands, packings, _ = candidates_for(name, hw)
    by_sig = {candidate.signature(c): c for c in cands}
    rows = [r for r in earlier if r["model"] == name]
    # every plan that fitted a budget then fits it now; every other plan does not
    fitting = {}
    for q in rows:
        if q["fits"]:
            fitting[q["budget"]] = max(fitting.get(q["budget"], 0), q["predicted_peak_bytes"])
    out = []
    for r in rows:
        k = r["config"]
        sig = (k["chunk_size"], k["activation_checkpointing"], k["rcache_blocks"], k["prefetch_depth"],
               k["optim_offload_chunks"], k["param_offload_chunks"])
        if sig not in by_sig:
            sys.exit(f"{name}: the earlier plan {k} is not among this planner's candidates; "
                     "replay a results file written by this version of the planner")
        budget = fitting[r["budget"]]
        c = by_sig[sig]
        plan = search.materialize(c, packings[c.chunk_size], profile, hw_w, WORLD, profile.dtype, "adamw", budget)
        plan.predictions["reason"] = r["reason"]
        if plan.predictions["peak_bytes"] != r["predicted_peak_bytes"]:
            print(f"note: {name} {r['budget']} {r['role']}: predicted peak now {plan.predictions['peak_bytes']} bytes, "
                  f"then {r['predicted_peak_bytes']}", flush=True)
        out.append({"model": name, "budget": r["budget"], "budget_bytes": budget, "role": r["role"],
                    "plan": plan.to_dict()})
    return out


def between_runs(summary: dict, earlier: list[dict]) -> None:
    """How far the measured order of the same plans carries from one run to the next, and
    how the predictions fare against both runs' steps together, one point per work.

    A prediction that does not know which run it faces can agree with one run's order
    only as far as the runs agree with each other: if every plan's median is its true
    step plus a run's own disturbance, two runs correlate at the measurement's reliability
    r, and the truth correlates with either at sqrt(r) (``ceiling_between_runs``; with a
    dozen plans the figure itself is uncertain by about 0.25). ``spearman_pooled`` sets
    this run's predictions against the median of both runs' timed steps, the benchmark's
    own measure over twice the steps; ``spearman_predictions_between_runs`` compares the
    two runs' predicted orders, each from its own calibration. Both runs count their
    rounds' steps only (extra rounds for a contested pair ran in one run alone)."""
    def rounds(rows: list[dict]) -> list[float]:
        """The round steps of one work; twins (plans of one work timed apart, as runs before
        works did) pool theirs."""
        distinct = {json.dumps(r["measured_detail"]["round_step_times_s"]): r for r in rows}
        return [t for r in distinct.values() for rt in r["measured_detail"]["round_step_times_s"] for t in rt]

    then: dict[str, list[dict]] = {}
    for p in earlier:
        then.setdefault(config_work(p), []).append(p)
    for model, s in summary["models"].items():
        uniq = list({config_work(p): p for p in summary["plans"] if p["model"] == model}.values())
        now_steps = [rounds([p]) for p in uniq]
        then_steps = [rounds(then[config_work(p)]) for p in uniq]
        then_pred = [then[config_work(p)][0]["predicted_step_s"] for p in uniq]
        r = spearman([statistics.median(t) for t in now_steps], [statistics.median(t) for t in then_steps])
        pooled = [statistics.median(a + b) for a, b in zip(now_steps, then_steps)]
        s["spearman_between_runs"] = r
        s["ceiling_between_runs"] = math.sqrt(r) if r > 0 else float("nan")
        s["spearman_earlier_prediction"] = spearman(then_pred, [statistics.median(t) for t in now_steps])
        s["spearman_pooled"] = spearman([p["predicted_step_s"] for p in uniq], pooled)
        s["spearman_predictions_between_runs"] = spearman([p["predicted_step_s"] for p in uniq], then_pred)


# ---------------------------------------------------------------------- running (ranks)
def allocator_peak(warm, fn) -> int:
    """Peak of the CPU allocator's running sum during fn(), relative to its start.

    The profiler does not report frees of memory allocated before it started, and the
    runtime frees and re-allocates gathered blocks every step (released chunks are resized
    to zero bytes). Profiling ``warm()`` (a full step) first makes every block fn() frees one
    whose allocation the profiler saw, so fn()'s running sum is exact."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    gc.disable()  # no collection of older garbage inside the window (it would count as frees)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            warm()
            with record_function("measured step"):
                fn()
    finally:
        gc.enable()
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == "measured step")
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    before = sum(e.nbytes() for e in memory if e.start_ns() < mark.start_ns())
    inside = (e.nbytes() for e in memory if mark.start_ns() <= e.start_ns() <= mark.end_ns())
    return max(itertools.accumulate(inside, initial=before)) - before


def run_plan(entry: dict, steps: int, warmup: int, measure_memory: bool) -> dict:
    """Wrap a fresh model in the entry's plan, train warmup + steps timed steps, and (with
    ``measure_memory``) two more to measure the peak; then close the runtime."""
    import hf_elixir as hfe

    rank = dist.get_rank()
    plan = hfe.ElixirPlan.from_dict(entry["plan"])
    model = build(entry["model"])
    vocab = model.config.vocab_size
    em = hfe.ElixirModule(model, plan)
    opt = hfe.ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, vocab, (BATCH[0] * WORLD, BATCH[1]), generator=g)
        ids = ids[rank * BATCH[0]:(rank + 1) * BATCH[0]]
        loss = em(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        return loss

    times, losses = [], []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(i)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    out = {"step_times_s": times, "losses": losses, "cache_stats": em.memory_report()["cache_stats"]}
    if measure_memory:  # what the runtime holds before a step plus what the allocator gives out in it
        held = em.memory_report()["current_total"]
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        dist.barrier()
        during = allocator_peak(lambda: step(warmup + steps), lambda: step(warmup + steps + 1))
        dist.barrier()
        out |= {"measured_peak_bytes": held + buffers + during, "held_bytes": held,
                "step_allocations_peak": during}
    em.close()  # waits for the next pass's prefetched gathers, gives back its process groups
    del em, opt, model
    gc.collect()
    return out


def reference_step(model: torch.nn.Module) -> float:
    """Median forward and backward of the plain model (no runtime, no communication) on every
    rank at once: how fast this machine is right now. Taken before each round, it records how
    far the machine drifted while the plans ran (``speed_by_round``)."""
    from hf_elixir.measure.calibrate import median_time

    ids = torch.randint(0, model.config.vocab_size, BATCH, generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    dist.barrier()
    return median_time(step, repeat=3)


def fits(entry: dict) -> bool:
    """Whether the entry's plan is predicted to fit the entry's budget."""
    return entry["plan"]["predictions"]["peak_bytes"] <= entry["budget_bytes"]


def plan_key(entry: dict) -> str:
    """Entries that run the same plan (one plan can be a candidate under several budgets).
    What the planner says of a plan (its predictions, the runners-up a chosen plan names)
    does not change what runs."""
    plan = {k: v for k, v in entry["plan"].items() if k not in ("predictions", "alternatives")}
    return entry["model"] + json.dumps(plan, sort_keys=True)


def _work(model: str, chunk_size: int, checkpointing: bool, rcache_blocks: int, n_chunks: int,
          prefetch_depth: int) -> str:
    """What a plan makes the runtime do on a CPU device, so that plans of one work can only
    differ in their steps by the machine's noise. An offloaded shard already lies in host
    memory there: the placements change what the runtime's ledger counts as device memory,
    not a single copy or operator (``cost.after_backward``). An rCache with more blocks than
    there are chunks behaves as one with exactly as many, and a model's chunk size decides
    its packing. Such twins are one point of the rank correlation, timed together."""
    return model + json.dumps([chunk_size, checkpointing, min(rcache_blocks, n_chunks), prefetch_depth])


def work_key(entry: dict) -> str:
    """The work (``_work``) of an entry's plan."""
    p = entry["plan"]
    return _work(entry["model"], p["chunk_size"], p["activation_checkpointing"], p["rcache_blocks"],
                 len(p["chunks"]), p["prefetch_depth"])


def config_work(row: dict) -> str:
    """The work (``_work``) of a results row, from its recorded config."""
    c = row["config"]
    return _work(row["model"], c["chunk_size"], c["activation_checkpointing"], c["rcache_blocks"],
                 c["n_chunks"], c["prefetch_depth"])


def candidate_work(c) -> str:
    """The work (``_work``) of a search candidate or an ElixirPlan, within one model."""
    from hf_elixir.planner.candidate import Candidate

    if isinstance(c, Candidate):
        return _work("", c.chunk_size, c.checkpointing, c.rcache_blocks, c.n_chunks, c.prefetch_depth)
    return _work("", c.chunk_size, c.activation_checkpointing, c.rcache_blocks, len(c.chunks), c.prefetch_depth)


def worker(rank: int, port: int, entries: list[dict], args, queue) -> None:
    """Run every distinct plan of the entries in the first round (where each plan's memory
    is measured), then one plan per distinct work (``_work``) in each later round, in
    rounds of alternating order (forward, backward, forward...): a drift of the machine's
    speed over the run then falls on early and late plans alike instead of on whichever
    plans ran last. The timed steps of all rounds are pooled per work."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one core per rank, as torchrun and accelerate launch set it
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from hf_elixir.runtime.host_memory import keep_freed_host_memory
    from hf_elixir.measure.steal import StealMeter

    keep_freed_host_memory()  # as the first ElixirModule would: every reference runs alike
    plain = {m: build(m) for m in dict.fromkeys(e["model"] for e in entries)}
    distinct: dict[str, dict] = {}  # the first entry of each plan, in the entries' order
    for e in entries:
        distinct.setdefault(plan_key(e), e)
    order = list(distinct)
    first_of_work: dict[str, str] = {}
    for key in order:
        first_of_work.setdefault(work_key(distinct[key]), key)
    results: dict[str, dict] = {}  # per plan: its memory and cache figures
    timing: dict[str, dict] = {}   # per work: its steps by round and in duels
    try:
        for model in plain.values():  # fresh ranks: the first steps run slow (heap settling)
            reference_step(model)
        for r in range(args.rounds):
            references = {m: reference_step(model) for m, model in plain.items()}
            keys = order if r == 0 else list(first_of_work.values())
            for j, key in enumerate(keys if r % 2 == 0 else keys[::-1]):
                e = distinct[key]
                meter = StealMeter()
                res = run_plan(e, args.steps, args.warmup, measure_memory=r == 0)
                stolen = meter.share()
                results.setdefault(key, res)
                got = timing.setdefault(work_key(e), {"round_step_times_s": [], "reference_step_s": [],
                                                      "steal_share": []})
                if len(got["round_step_times_s"]) == r:  # the work's first plan this round
                    got["round_step_times_s"].append([])
                    got["reference_step_s"].append(references[e["model"]])
                    got["steal_share"].append([])
                got["round_step_times_s"][r] += res["step_times_s"]
                got["steal_share"][r].append(stolen)
                if rank == 0:
                    pred = e["plan"]["predictions"]
                    times = _timed(got)
                    print(f"[round {r + 1}/{args.rounds}, {j + 1}/{len(keys)}] {e['model']:10s} "
                          f"pred {pred['step_time_s']:.3f} s: this round {statistics.median(res['step_times_s']):.3f} s, "
                          f"all rounds {statistics.median(times):.3f} s, plain model {references[e['model']]:.3f} s"
                          + (f", {stolen:.0%} of the CPU stolen" if stolen is not None else ""),
                          flush=True)
        # a budget whose chosen plan did not measure fastest among those that fit: the two
        # plans again, alternating, until the pair has been timed often enough to tell apart
        pairs = [contested(entries, timing) if rank == 0 else None]
        dist.broadcast_object_list(pairs, src=0)  # rank 1's own timings could pick other pairs
        for d in range(args.duel_rounds if pairs[0] else 0):
            for pair in pairs[0]:
                for key in pair if d % 2 == 0 else pair[::-1]:
                    res = run_plan(distinct[first_of_work[key]], args.steps, args.warmup, measure_memory=False)
                    timing[key].setdefault("duel_step_times_s", []).append(res["step_times_s"])
            if rank == 0:
                print(f"[duel round {d + 1}/{args.duel_rounds}] " + "; ".join(
                    f"{_median(timing[a]):.3f} s against {_median(timing[b]):.3f} s" for a, b in pairs[0]), flush=True)
        if rank == 0:
            for key, got in results.items():
                work = timing[work_key(distinct[key])]
                times = _timed(work)
                queue.put((key, got | work | {"step_times_s": times, "measured_step_s": statistics.median(times),
                                              "fastest_step_s": min(times)}))
    finally:
        dist.destroy_process_group()


def _timed(got: dict) -> list[float]:
    """Every timed step of one work: its rounds and its duels."""
    return [t for rt in got["round_step_times_s"] + got.get("duel_step_times_s", []) for t in rt]


def _median(got: dict) -> float:
    return statistics.median(_timed(got))


def contested(entries: list[dict], timing: dict[str, dict]) -> list[tuple[str, str]]:
    """(chosen, fastest measured) work keys of each budget whose chosen plan did not measure
    fastest among the plans that fit it. Such a pair is often a near-tie: two steps a round
    move by 10-40% on this VM, so the pair is timed again before the rank is recorded."""
    pairs: list[tuple[str, str]] = []
    for budget in dict.fromkeys(e["budget"] for e in entries):
        rows = [e for e in entries if e["budget"] == budget]  # the chosen plan comes first
        chosen = work_key(rows[0])
        fit = [work_key(e) for e in rows if fits(e)]
        best = min(fit, key=lambda k: _median(timing[k]))
        if best != chosen and (chosen, best) not in pairs:
            pairs.append((chosen, best))
    return pairs


def run_all(entries: list[dict], args) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from hf_elixir.runtime.host_memory import spawning_cpu_ranks

    procs = [ctx.Process(target=worker, args=(r, port, entries, args, queue)) for r in range(WORLD)]
    with spawning_cpu_ranks():  # as hf-elixir launch starts CPU ranks
        for p in procs:
            p.start()
    keys = set(plan_key(e) for e in entries)
    got: dict[str, dict] = {}
    while len(got) < len(keys):
        try:
            k, res = queue.get(timeout=5)
            got[k] = res
        except Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit("a rank failed; see its traceback above")
    for p in procs:
        p.join()
    return [dict(e, measured=got[plan_key(e)]) for e in entries]


# ---------------------------------------------------------------------- analysis
def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation; tied values share the mean of their ranks (two plans
    predicted alike are not ordered by the order they were listed in)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        pos = 0
        while pos < len(order):
            end = pos
            while end + 1 < len(order) and v[order[end + 1]] == v[order[pos]]:
                end += 1
            for i in order[pos:end + 1]:
                r[i] = (pos + end) / 2
            pos = end + 1
        return r

    if len(xs) < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else float("nan")


def split_half(plans: list[dict]) -> float:
    """Spearman of the plans' median steps over rounds 1 and 4 (5, 8, ...) against those
    over rounds 2 and 3 (6, 7, ...): how well the measured order reproduces itself. Each
    half has a forward and a backward round, so a drift along the run order falls on both.
    The whole measurement, with twice the steps of a half, reproduces better than this;
    ``noise_ceiling`` turns it into the figure a prediction can be held to."""
    if len(plans) < 2 or len(plans[0]["measured_detail"]["round_step_times_s"]) < 2:
        return float("nan")
    halves: tuple[list[float], list[float]] = ([], [])
    for p in plans:
        rounds = p["measured_detail"]["round_step_times_s"]
        for h, keep in enumerate(((0, 3), (1, 2))):
            halves[h].append(statistics.median(t for i, r in enumerate(rounds) if i % 4 in keep for t in r))
    return spearman(*halves)


def noise_ceiling(split: float) -> float:
    """The correlation a prediction that knew every plan's true step would be expected to
    reach against the whole measurement, given the halves' agreement ``split``.

    Classical test theory: doubling the steps raises the measurement's reliability to
    2r / (1 + r) (Spearman-Brown), and a perfect predictor correlates with a measurement
    at the square root of its reliability. Stated for Pearson's correlation, it serves as
    an estimate for ranks.
    """
    if not split > 0:
        return float("nan")
    return math.sqrt(2 * split / (1 + split))


def summarise(rows: list[dict]) -> dict:
    """Per plan and per model. A plan's measured step is the median of its timed steps from
    every round; the same figures from its fastest step are kept under ``*_fastest`` keys,
    and ``round_medians_s`` shows how much one round alone moved.
    ``speed_by_round`` is the plain model's step before each round over the first round's:
    above 1 the machine had slowed down. ``steal_share_by_round``: the median share of the
    CPU time the hypervisor took while a plan ran (``hf_elixir.measure.steal``), per round; the
    machine's own slow spells show there."""
    out: dict = {"plans": [], "models": {}}
    for r in rows:
        pred, meas = r["plan"]["predictions"], r["measured"]
        out["plans"].append({
            "model": r["model"], "budget": r["budget"], "role": r["role"],
            "reason": pred.get("reason", "chosen"),
            "fits": fits(r),
            "predicted_step_s": pred["step_time_s"], "measured_step_s": meas["measured_step_s"],
            "step_error": pred["step_time_s"] / meas["measured_step_s"] - 1,
            "fastest_step_s": meas["fastest_step_s"],
            "step_error_fastest": pred["step_time_s"] / meas["fastest_step_s"] - 1,
            "round_medians_s": [statistics.median(t) for t in meas["round_step_times_s"]],
            "predicted_peak_bytes": pred["peak_bytes"], "measured_peak_bytes": meas["measured_peak_bytes"],
            "peak_error": pred["peak_bytes"] / meas["measured_peak_bytes"] - 1,
            "config": {k: r["plan"][k] for k in ("chunk_size", "rcache_blocks", "activation_checkpointing",
                                                  "prefetch_depth")}
            | {"optim_offload_chunks": sum(c["optim_placement"] == "cpu" for c in r["plan"]["chunks"]),
               "param_offload_chunks": sum(c["param_placement"] == "cpu" for c in r["plan"]["chunks"]),
               "n_chunks": len(r["plan"]["chunks"])},
            "predicted_time": pred["time"], "predicted_memory": pred["memory"],
            "measured_detail": {k: meas.get(k, []) for k in ("round_step_times_s", "duel_step_times_s", "held_bytes",
                                                              "step_allocations_peak", "cache_stats",
                                                              "reference_step_s", "steal_share")},
        })
    for model in dict.fromkeys(p["model"] for p in out["plans"]):
        mine = [p for p in out["plans"] if p["model"] == model]
        # one point per distinct work (a plan can be a candidate under several budgets, and
        # plans that differ only in what the ledger counts run the same steps: _work)
        uniq = list({work_key(r): p for r, p in zip(rows, out["plans"]) if p["model"] == model}.values())
        refs = mine[0]["measured_detail"]["reference_step_s"]  # one per round, alike for every plan
        split = split_half(uniq)
        per_budget = {}
        for b in dict.fromkeys(p["budget"] for p in mine):
            rows_b = [p for p in mine if p["budget"] == b]
            chosen = rows_b[0]
            fit = [p for p in rows_b if p["fits"]]
            best = min(p["measured_step_s"] for p in fit)
            rank = sorted(p["measured_step_s"] for p in fit).index(chosen["measured_step_s"]) + 1
            per_budget[b] = {"chosen_vs_best_fitting": chosen["measured_step_s"] / best,
                             "chosen_measured_rank": rank, "fitting_candidates": len(fit)}
        out["models"][model] = {
            "spearman_step_time": spearman([p["predicted_step_s"] for p in uniq],
                                           [p["measured_step_s"] for p in uniq]),
            "max_abs_step_error": max(abs(p["step_error"]) for p in mine),
            "spearman_split_half": split,
            "spearman_noise_ceiling": noise_ceiling(split),
            "spearman_step_time_fastest": spearman([p["predicted_step_s"] for p in uniq],
                                                   [p["fastest_step_s"] for p in uniq]),
            "max_abs_step_error_fastest": max(abs(p["step_error_fastest"]) for p in mine),
            "speed_by_round": [ref / refs[0] for ref in refs],
            "steal_share_by_round": _steal_by_round(uniq),
            "max_abs_peak_error": max(abs(p["peak_error"]) for p in mine),
            "budgets": per_budget,
        }
    return out


def _steal_by_round(plans: list[dict]) -> list[float | None]:
    """Median stolen CPU share of the visits of each round (None where it was not counted)."""
    per_round: dict[int, list[float]] = {}
    for p in plans:
        for r, shares in enumerate(p["measured_detail"].get("steal_share") or []):
            per_round.setdefault(r, []).extend(v for v in shares if v is not None)
    return [statistics.median(v) if v else None for _, v in sorted(per_round.items())]


def plot(summary: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    colours = {"gpt2-30m": "#4a7", "gpt2-124m": "#c66", "llama-60m": "#46c"}
    for ax, key, unit, scale in ((axes[0], "step_s", "s", 1.0), (axes[1], "peak_bytes", "MiB", 2**20)):
        lo, hi = float("inf"), 0.0
        for p in summary["plans"]:
            x, y = p[f"measured_{key}"] / scale, p[f"predicted_{key}"] / scale
            lo, hi = min(lo, x, y), max(hi, x, y)
            ax.scatter(x, y, c=colours.get(p["model"], "#888"), marker="*" if p["role"] == "chosen" else "o",
                       s=80 if p["role"] == "chosen" else 25, label=p["model"])
        band = 0.25 if key == "step_s" else 0.10
        xs = [lo * 0.9, hi * 1.1]
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.fill_between(xs, [x * (1 - band) for x in xs], [x * (1 + band) for x in xs], color="#ddd", alpha=0.5)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title(f"{'step time' if key == 'step_s' else 'peak memory per rank'} (band ±{band:.0%})")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    import hf_elixir as hfe

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rounds", type=int, default=6, help="passes over the plans, in alternating order")
    p.add_argument("--steps", type=int, default=3, help="timed steps per plan and round")
    p.add_argument("--duel-rounds", type=int, default=4,
                   help="extra alternating rounds for a budget's chosen plan and the fastest that fits, "
                        "when they differ")
    # the first step records the chunk trace; on a CPU the heap grows over two steps before
    # every allocation reuses kept memory (runtime/host_memory.py); a slower third step is
    # one of twelve in a median
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per plan and round")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="plan with the cached calibration instead of calibrating before each model")
    p.add_argument("--alternatives", type=int, default=3, help="runners-up per budget")
    p.add_argument("--spread", type=int, default=3, help="extra fitting candidates per budget")
    p.add_argument("--replay", metavar="RESULTS_JSON",
                   help="run again the very plans of an earlier results file (same rounds, no extra "
                        "rounds for contested pairs) and report how far the two runs' measured orders agree")
    p.add_argument("--out", default=None,
                   help="results file (default: results/bench_planner.json, or bench_planner_replay.json with --replay)")
    args = p.parse_args()
    earlier = json.loads(Path(args.replay).read_text())["plans"] if args.replay else None
    if earlier is not None:
        args.duel_rounds = 0  # both runs' medians from the same rounds
        args.models = [m for m in args.models if any(r["model"] == m for r in earlier)]
    args.out = args.out or str(RESULTS / ("bench_planner_replay.json" if earlier else "bench_planner.json"))

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows, hardware, efficiency = [], {}, {}
    for m in args.models:
        # calibrated minutes before its plans run: this VM's speed drifts by 10-30% over an
        # hour (DDP's own GPT-2 30M step: 1.13 s one session, 1.33 s and 0.95 s the next),
        # and a prediction can be no closer to a measurement than its calibration
        hw = hfe.measure.calibrate_machine() if args.calibrate else hfe.HardwareProfile.detect()
        entries = replay_entries(m, hw, earlier) if earlier else plans_for(m, hw, args.alternatives, args.spread)
        print(f"{m}: {len(entries)} plans to run on {hw.name}", flush=True)
        # each model in fresh ranks: ranks that have run dozens of plans run the later ones
        # measurably slower (Llama-60M after 34 plans: 1.3-2.2 s a step; fresh: 1.2-1.5 s)
        rows += run_all(entries, args)
        hardware[m] = hw.to_dict() if hasattr(hw, "to_dict") else hw.name
        efficiency[m] = next((e["plan"]["predictions"].get("compute_efficiency") for e in entries
                              if e["role"] == "chosen"), None)
    summary = summarise(rows)
    if earlier:
        between_runs(summary, earlier)
        summary["replay_of"] = args.replay
    summary["hardware"] = hardware
    summary["compute_efficiency"] = efficiency
    summary["seconds"] = time.perf_counter() - t0
    for model, s in summary["models"].items():
        print(f"{model}: spearman {s['spearman_step_time']:.2f}, max |step error| "
              f"{s['max_abs_step_error']:.0%} (noise ceiling {s['spearman_noise_ceiling']:.2f}, halves {s['spearman_split_half']:.2f}; "
              f"by fastest steps: {s['spearman_step_time_fastest']:.2f}, {s['max_abs_step_error_fastest']:.0%}), "
              f"max |peak error| {s['max_abs_peak_error']:.0%}; "
              f"plain model's step by round: {', '.join(f'{v:.2f}' for v in s['speed_by_round'])} of the first; "
              f"CPU stolen by round: {', '.join('-' if v is None else f'{v:.0%}' for v in s['steal_share_by_round'])}")
        if "spearman_between_runs" in s:
            print(f"   the earlier run's measured order against this run's: spearman {s['spearman_between_runs']:.2f} "
                  f"(a run-independent prediction can reach about {s['ceiling_between_runs']:.2f}); "
                  f"the earlier predictions against this run: {s['spearman_earlier_prediction']:.2f}; "
                  f"this run's predictions against both runs' steps: {s['spearman_pooled']:.2f}; "
                  f"the two runs' predicted orders: {s['spearman_predictions_between_runs']:.2f}")
        for b, v in s["budgets"].items():
            print(f"   {b:6s} chosen/best fitting {v['chosen_vs_best_fitting']:.3f} "
                  f"(rank {v['chosen_measured_rank']} of {v['fitting_candidates']})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    plot(summary, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
