"""The planner's fast replay and step simulation against the straightforward ones they
replaced (``planner_reference``): the same gathers, waits and prefetches at every fetch, and
the same predicted figures to the last bit, on random request sequences (nested pins,
modules spanning several chunks or none, unbalanced unpins, frozen and offloaded chunks,
rCaches too small to hold what is pinned) and on the traces of real models under every
configuration the search tries."""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import pytest

import planner_reference as ref
from hf_elixir.hardware import HardwareProfile
from hf_elixir.planner import cost, fetches, packing, search
from hf_elixir.planner.efficiency import compute_figures
from hf_elixir.profile import profile_model
from hf_elixir.profile.needs import rcache_minimum


def _fast(requests: fetches.Requests, *args) -> tuple:
    """``fetches.replay`` in the reference's form, or the error it raised."""
    try:
        r = fetches.replay(requests, *args)
    except ValueError as e:
        return ("error", str(e)), None
    return (r.carried, [(f.event, f.demand, f.waits, f.ahead) for f in r.fetches], r.gathers), r


def _slow(requests: fetches.Requests, *args) -> tuple:
    try:
        return ref.replay(requests, *args)
    except ValueError as e:
        return ("error", str(e))


def _same_sim(got: cost.SimResult, want: cost.SimResult, where: str) -> None:
    for f in fields(cost.SimResult):
        assert getattr(got, f.name) == getattr(want, f.name), f"{where}: {f.name}"


# ---------------------------------------------------------------------- random sequences
def _random_trace(rng: random.Random, n_chunks: int):
    """Pins of a random step (forward then backward, some calls nested, some recomputed
    without an event of their own, a few unpins of nothing), its events, and which chunks
    each module's parameters lie in."""
    modules = [f"m{i}" for i in range(rng.randint(3, 12))]
    module_params: dict[str, list[str]] = {}
    chunk_of: dict[str, int] = {}
    for m in modules:
        spans = rng.choice([0, 1, 1, 1, 2, 3])
        module_params[m] = [f"{m}.p{j}" for j in range(spans)]
        for j, p in enumerate(module_params[m]):
            chunk_of[p] = rng.randrange(n_chunks)
    pins: list[tuple[str, str]] = []
    events: list[tuple[str, str]] = []

    def call(phase: str, depth: int) -> None:
        m = rng.choice(modules)
        if rng.random() < 0.85:
            events.append((phase, m))
        pins.append(("pin", m))
        while depth < 3 and rng.random() < 0.3:  # calls nested in it
            call(phase, depth + 1)
        if rng.random() < 0.05:
            pins.append(("unpin", rng.choice(modules)))  # maybe nothing of it pinned: stays at zero
        pins.append(("unpin", m))

    for phase in ("forward", "backward"):
        for _ in range(rng.randint(5, 40)):
            call(phase, 0)
    return pins, events, module_params, chunk_of


@dataclass
class _Figs:
    """The one figure ``simulate`` asks of ComputeFigures: the runtime's own copies."""

    per_byte: float

    def copy_seconds(self, nbytes: float, fresh: bool) -> float:
        return nbytes * self.per_byte * (2.0 if fresh else 1.0)


@pytest.mark.parametrize("seed", range(60))
def test_random_sequences_replay_and_simulate_as_the_reference(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    pins, events, module_params, chunk_of = _random_trace(rng, n)
    requests = fetches.fetch_ops(pins, module_params, chunk_of, n, events)
    frozen = frozenset(c for c in range(n) if rng.random() < 0.4)
    trainable = [c for c in range(n) if c not in frozen]
    seq = [cost.Access(ph, m, tuple(sorted({chunk_of[p] for p in module_params[m]})), rng.uniform(0.1, 2.0))
           for ph, m in events]
    chunk_bytes = [float(rng.randint(1, 9) * 1024) for _ in range(n)]
    adopted = frozenset(c for c in trainable if rng.random() < 0.3)
    overlap = rng.choice([1.0, rng.random()])  # below 1: communication beside compute slows it
    links = cost.Links(latency=rng.uniform(0, 0.1), gather_per_byte=rng.uniform(0, 1e-3),
                       reduce_per_byte=rng.uniform(0, 1e-3), h2d_per_byte=rng.uniform(0, 1e-3),
                       gather_overlap=overlap, reduce_overlap=rng.choice([1.0, rng.random()]),
                       figs=_Figs(rng.uniform(0, 1e-4)))
    checked = 0
    for world_size in (1, 2):
        setup = cost.sim_setup(seq, chunk_bytes, world_size, links, adopted, frozen)
        for blocks in range(1, n + 2):
            for prefetch in (0, 1, 2, 3):  # one Requests for all: the recorded pass is shared
                on_host = frozenset(c for c in range(n) if rng.random() < 0.5)
                args = (blocks, prefetch, world_size, on_host, frozen)
                got, replayed = _fast(requests, *args)
                want = _slow(requests, *args)
                assert got == want, (seed, args)
                if replayed is None:
                    continue
                for param_cpu in (frozenset(), on_host):  # one replay simulated under two placements
                    sim = cost.simulate(seq, replayed, chunk_bytes, world_size, links, param_cpu, adopted,
                                        frozen, setup=setup)
                    _same_sim(sim, ref.simulate(seq, want, chunk_bytes, world_size, links, param_cpu,
                                                adopted, frozen), f"seed {seed} {args} {sorted(param_cpu)}")
                    checked += 1
    assert checked  # some rCache held what the step pins


@pytest.mark.parametrize("seed", range(20))
def test_at_world_size_one_every_rcache_holding_the_offloaded_chunks_replays_alike(seed):
    """What lets the search replay once for all such rCaches (``search._Replays``): at world
    size 1 only offloaded chunks take blocks, so with a block for each nothing is evicted."""
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 9)
    pins, events, module_params, chunk_of = _random_trace(rng, n)
    requests = fetches.fetch_ops(pins, module_params, chunk_of, n, events)
    frozen = frozenset(c for c in range(n) if rng.random() < 0.4)
    on_host = frozenset(c for c in range(n) if rng.random() < 0.5)
    for prefetch in (0, 1, 2):
        least = _slow(requests, max(1, len(on_host)), prefetch, 1, on_host, frozen)
        for blocks in range(len(on_host) + 1, n + 3):
            assert _slow(requests, blocks, prefetch, 1, on_host, frozen) == least


# ---------------------------------------------------------------------- real traces
def _lora_gpt2():
    from peft import LoraConfig, get_peft_model
    from tiny_models import make_model

    return get_peft_model(make_model("gpt2"), LoraConfig(r=4, target_modules=["c_attn", "c_fc"], lora_dropout=0.0))


def _llama():
    from tiny_models import make_model

    return make_model("llama")


@pytest.mark.parametrize("build,world_size,hardware", [(_lora_gpt2, 2, "rtx4090"), (_lora_gpt2, 1, "rtx4090"),
                                                       (_llama, 2, "cpu"), (_llama, 1, "a100-80g")])
def test_search_configurations_of_real_traces_as_the_reference(build, world_size, hardware):
    """Every (chunk size, checkpointing, rCache, prefetch) the search tries on a small model's
    trace, with offloaded tails as it makes them: the replay and the simulated step are the
    reference's. On the ``cpu`` preset communication beside compute slows it (the compute
    intervals are worked out too)."""
    model = build()
    prof = profile_model(model, (2, 16), dtype="float32", attention_target="cpu" if hardware == "cpu" else "cuda")
    hw = HardwareProfile.preset(hardware).with_cluster(gpus_per_node=world_size)
    figs = compute_figures(prof, hw, world_size, None)
    links = cost.Links.of(hw, world_size, figs)
    sizes = {p.name: p.numel for p in prof.params}
    frozen_names = frozenset(p.name for p in prof.params if p.frozen)
    replays = 0
    for S in packing.chunk_size_candidates(sizes.values(), world_size):
        chunks = packing.pack(prof.param_order(), sizes, S, frozen_names)
        n = len(chunks)
        frozen = search.frozen_chunk_ids(chunks, frozen_names)
        trainable = [c for c in range(n) if c not in frozen]
        tails = [frozenset(sorted(frozen)[len(frozen) - f:]) for f in (0, 1, len(frozen)) if f <= len(frozen)]
        tails += [frozenset(trainable[-1:]) | frozen]
        param_chunk = {name: i for i, c in enumerate(chunks) for name in c}
        elems = packing.layout_sizes(chunks, sizes, world_size, 4)
        chunk_bytes = [e * 4 for e in elems]
        adopted = packing.adopting_chunks(chunks, sizes, elems) - frozen
        for ckpt in ([False, True] if prof.checkpointed is not None else [False]):
            tr = prof.step(ckpt).trace
            seq = cost.access_sequence(tr.events, tr.module_params, tr.work, param_chunk, lambda w: w.ops * 1e-3)
            requests = fetches.fetch_ops(tr.pins, tr.module_params, param_chunk, n, tr.events)
            setup = cost.sim_setup(seq, chunk_bytes, world_size, links, adopted, frozen)
            least = max(2, cost.max_span(tr.module_params, param_chunk) + 1,
                        rcache_minimum(tr.pins, tr.module_params, chunks))
            for prefetch in search.PREFETCH_DEPTHS:
                for blocks in search._rcache_grid(least, max(n, least)):
                    for on_host in tails:
                        args = (blocks, prefetch, world_size, on_host if world_size == 1 else frozenset(), frozen)
                        got, replayed = _fast(requests, *args)
                        want = _slow(requests, *args)
                        assert got == want, (S, ckpt, args)
                        sim = cost.simulate(seq, replayed, chunk_bytes, world_size, links, on_host, adopted,
                                            frozen, setup=setup)
                        _same_sim(sim, ref.simulate(seq, want, chunk_bytes, world_size, links, on_host, adopted,
                                                    frozen), f"{S} {ckpt} {args}")
                        replays += 1
    assert replays > 20
