"""Measure the figures the cost model prices a step with, on this machine, in under a minute.

The cost model (``hf_elixir.planner.cost``) prices each stretch of a step by the operators the
profiler saw in it (``EventWork``): matmuls by their FLOPs at the rate a matmul *of that
size* reaches, every other operator by the bytes it moves plus a fixed cost per call. So
that is what is measured here, rather than a peak matmul rate:

- **matmul rate by size**: the three matmuls of a linear layer's forward and backward
  (``x @ w``, ``g @ w.T``, ``x.T @ g``) at a ladder of sizes;
- **memory rates**: reading (and rewriting in place) mapped memory, and, by size, writing a
  newly allocated output (on a CPU a large one pays the page faults of first touch, which
  dominate a large fill or add: 77 MB of zeros take 50 ms on one core here, an in-place add
  over them 7 ms);
- **cost per operator call**: a chain of tiny operators through forward and backward, so
  dispatch and autograd bookkeeping are in it;
- **a small causal LM's forward and backward** (embedding, a transformer block, the LM head
  and the loss) at three shapes, measured and then priced from its own meta trace with the
  figures above; the ratio is ``efficiency``, the correction the cost model applies to what
  the per-operator figures miss;
- **the optimizer kernel the runtime uses** (fused AdamW over views of one flat shard) and,
  on a GPU machine, **the host's whole work per offloaded element** (``host_rate.py``);
- **the runtime's own collectives** (``hf_elixir.runtime.comm.Collectives``) between two
  local processes at chunk-sized buffers, all-gather and gradient reduction separately
  (on gloo they are different algorithms).

On a CPU every rank of a multi-process run gets one thread (``torchrun`` and ``accelerate
launch`` set ``OMP_NUM_THREADS=1``), and ranks share the memory bus, so the per-rank figures
are measured in two processes at once with one thread each; a one-process run uses every
core, so its figures are measured once more that way. Each set is a ``ComputeFigures`` in
``HardwareProfile.compute``: ``"shared"`` (several ranks per node) and ``"whole"`` (one).
"""

from __future__ import annotations

import gc
import math
import socket
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import nn

from hf_elixir.profile.memory import matmul_layout
from hf_elixir.hardware import ComputeFigures
from hf_elixir.planner.pricing import price
from hf_elixir.vocab import torch_dtype
from hf_elixir.runtime.host_memory import keep_freed_host_memory, spawning_cpu_ranks
from hf_elixir.planner.record import ElixirPlan
from hf_elixir.runtime.module import ElixirModule
from hf_elixir.profile.memory import LiveStorageTracker, SDPAKernelMode, loss_of
from hf_elixir.profile.trace import EventWork, build_meta_model, make_batch, set_training
from hf_elixir.runtime.comm import Collectives

#: matmul shapes (tokens, in, out) of the ladder; ordered by FLOPs
_MM_SHAPES = [(64, 128, 128), (128, 256, 256), (256, 384, 384), (256, 384, 1536), (256, 768, 768),
              (256, 768, 3072), (512, 1024, 4096), (256, 768, 32000), (1024, 2048, 8192)]
_MM_SHAPES_QUICK = [(64, 128, 128), (256, 384, 384), (256, 768, 3072)]


def best_time(fn: Callable[[], object], repeat: int = 3, sync: Callable[[], None] | None = None,
              budget: float = 1.0) -> float:
    """The fastest of ``repeat`` timed calls after one warm-up (fewer when one takes long)."""
    fn()
    if sync:
        sync()
    best = float("inf")
    spent = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        dt = time.perf_counter() - t
        best = min(best, dt)
        spent += dt
        if spent > budget:
            break
    return max(best, 1e-9)


def median_time(fn: Callable[[], object], repeat: int = 5, sync: Callable[[], None] | None = None,
                budget: float = 3.0) -> float:
    """The median of ``repeat`` timed calls after one warm-up (at least three; fewer than
    ``repeat`` when they take longer than ``budget`` seconds): what a training loop's steady
    step sees, where ``best_time`` gives a kernel's best case."""
    fn()
    if sync:
        sync()
    times: list[float] = []
    while len(times) < repeat and (len(times) < 3 or sum(times) < budget):
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t)
    return max(statistics.median(times), 1e-9)


# ---------------------------------------------------------------------- compute
def measure_compute(device: torch.device, dtypes: tuple[str, ...] = ("float32",), quick: bool = False,
                    threads: int | None = None) -> ComputeFigures:
    """Every ``ComputeFigures`` field on ``device`` with the current thread setting."""
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    if device.type == "cpu":  # as ElixirModule runs: freed memory stays mapped (no page faults)
        keep_freed_host_memory()
    figs = ComputeFigures(threads=threads or torch.get_num_threads())
    for dtype in dtypes:
        figs.matmul_curve[dtype], figs.matmul_layouts[dtype] = _matmul_curves(device, torch_dtype(dtype), sync, quick)
    figs.op_overhead = _op_overhead(device, sync)
    figs.read_bandwidth, figs.write_curve = _memory_rates(device, sync, figs.op_overhead, quick)
    figs.strided_bandwidth = _strided_rate(device, sync, figs, quick)
    figs.special_rate = _special_rate(device, sync, figs.op_overhead)
    figs.adam_rate = adam_rate(device, (1 if quick else 8) * 2**20, sync)
    figs.event_overhead = runtime_event_overhead(device, sync)
    figs.efficiency_curve = block_efficiency(figs, device, sync, quick)
    figs.efficiency = statistics.median(r for _, r in figs.efficiency_curve)
    figs.update_rate = update_rate(device, update_elems(quick), sync)
    return figs


def _by_size(points: dict[float, list[float]]) -> list[list[float]]:
    """Mean rate per size, ascending. Not forced monotone: a wide LM head's product runs
    well below a square one of the same FLOPs, and the ladder includes both."""
    return [[f, statistics.mean(points[f])] for f in sorted(points)]


#: operand bytes the matmul timings cycle through: more than a CPU's last-level cache or a
#: GPU's L2 (50-60 MiB on H100/H200), so every product reads its operands
#: from memory as a layer in a model does. On hot operands (one product timed again and
#: again) the narrow products of small models ran 15-30% faster than on cold ones, and the
#: same products inside GPT-2 ran 1.4-1.75x slower than their hot-operand price.
_COLD_BYTES = 96 * 2**20


def _linear_products(t: int, k: int, n: int, device, dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(a, b, out) of a linear layer's forward and backward products, in both weight
    layouts, writing into existing outputs (writing fresh memory is priced apart)."""
    x, g = torch.randn(t, k, device=device, dtype=dtype), torch.randn(t, n, device=device, dtype=dtype)
    w_lin = torch.randn(n, k, device=device, dtype=dtype)   # nn.Linear: (out, in)
    w_conv = torch.randn(k, n, device=device, dtype=dtype)  # Conv1D: (in, out)
    out = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)  # noqa: E731 (pages touched)
    return [(x, w_lin.t(), out(t, n)), (g, w_lin, out(t, k)), (g.t(), x, out(n, k)),
            (x, w_conv, out(t, n)), (g, w_conv.t(), out(t, k)), (x.t(), g, out(k, n))]


def _matmul_curves(device, dtype, sync, quick) -> tuple[list[list[float]], dict[str, list[list[float]]]]:
    """Rates of the matmuls of a linear layer's forward and backward, in both weight layouts
    Hugging Face models use (nn.Linear keeps W as (out, in), GPT-2's Conv1D as (in, out)),
    by size and layout; and the rate of all of them together, by size. Each is the median
    pass over as many copies of its operands as fill ``_COLD_BYTES`` (cold operands)."""
    overall: dict[float, list[float]] = {}
    by_layout: dict[str, dict[float, list[float]]] = {}
    budget = 0.2 if quick else 0.5
    for t, k, n in (_MM_SHAPES_QUICK if quick else _MM_SHAPES):
        flops = 2.0 * t * k * n
        if device.type == "cpu" and flops > (2e9 if quick else 2e10):
            continue
        first = _linear_products(t, k, n, device, dtype)
        per_copy = sum({st.data_ptr(): st.nbytes() for a, b, out in first for st in
                        (a.untyped_storage(), b.untyped_storage(), out.untyped_storage())}.values())
        copies = max(1, min(64, _COLD_BYTES // per_copy))
        sets = [first] + [_linear_products(t, k, n, device, dtype) for _ in range(copies - 1)]
        total = 0.0
        for j in range(len(sets[0])):
            products = [products_of_copy[j] for products_of_copy in sets]

            def one_pass():
                for a, b, out in products:
                    torch.mm(a, b, out=out)

            sec = median_time(one_pass, repeat=3, sync=sync, budget=budget) / copies
            total += sec
            layout = matmul_layout(torch.ops.aten.mm.default, products[0][:2])
            by_layout.setdefault(layout, {}).setdefault(flops, []).append(flops / sec)
        overall.setdefault(flops, []).append(len(sets[0]) * flops / total)
        del sets
    return _by_size(overall), {lay: _by_size(pts) for lay, pts in by_layout.items()}


def _op_overhead(device, sync) -> float:
    """Seconds per operator call through forward and backward, on tiny tensors."""
    x = torch.ones(16, device=device, requires_grad=True)
    n = 200

    def chain():
        y = x
        for _ in range(n):
            y = y * 1.0001
        y.sum().backward()

    # forward: n muls + sum; backward: n muls, the sum's expand, gradient accumulation
    return best_time(chain, repeat=5, sync=sync) / (2 * n + 3)


def _memory_rates(device, sync, overhead: float, quick: bool) -> tuple[float, list[list[float]]]:
    """Read bandwidth (an in-place add over mapped memory) and, by size, the rate of writing
    a newly allocated output (an out-of-place add, less its reads)."""
    n = (4 if quick else 16) * 2**20
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    read = 2 * n * 4 / max(best_time(lambda: x.add_(y), repeat=3, sync=sync) - overhead, 1e-9)
    curve = []
    # glibc serves allocations under its mmap threshold (up to 32 MiB) from a reused heap and
    # maps larger ones afresh each time, so the rate falls off a cliff there, unless freed
    # memory stays mapped (runtime/host_memory.py; what a CPU ElixirModule sets)
    for size in ([2**16, 2**22] if quick else [2**14, 2**20, 2**23, 2**24, 2**25 - 2**20, 2**25 + 2**20, 2**26]):
        m = size // 4
        a, b = x[:m] if m <= n else torch.randn(m, device=device), y[:m] if m <= n else torch.randn(m, device=device)
        calls = max(1, min(64, 2**24 // size))

        def fresh():
            for _ in range(calls):
                torch.add(a, b)  # freed at once: the next result is a new allocation

        sec = best_time(fresh, repeat=3, sync=sync) / calls - overhead - 2 * size / read
        curve.append([float(size), size / max(sec, size / (4 * read))])
    return read, curve


def _special_rate(device, sync, overhead: float) -> float:
    """Elements/s of tanh, exp and a softmax into existing outputs (their mean)."""
    x = torch.randn(2**20, device=device)
    out = torch.empty_like(x)
    rates = []
    for fn in (lambda: torch.tanh(x, out=out), lambda: torch.exp(x, out=out),
               lambda: torch.softmax(x.view(256, -1), -1, out=out.view(256, -1))):
        rates.append(x.numel() / max(best_time(fn, repeat=3, sync=sync) - overhead, 1e-9))
    return statistics.mean(rates)


def _strided_rate(device, sync, figs: "ComputeFigures", quick: bool) -> float:
    """Bytes/s read by ``a + b.T`` (same shape, opposite layouts), less its fresh output."""
    n = 1024 if quick else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    sec = best_time(lambda: torch.add(a, b.t(), out=out), repeat=3, sync=sync) - figs.op_overhead
    return 2 * n * n * 4 / max(sec, 1e-9)


def runtime_event_overhead(device: torch.device, sync=None, layers: int = 48) -> float:
    """Seconds ``ElixirModule``'s hooks add per fetch event: a stack of tiny layers trained
    through the runtime (one rank, every chunk in place) against the same stack plainly."""
    def stack() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]).to(device)

    x = torch.randn(4, 8, device=device)

    def timed(model: nn.Module) -> float:
        def step():
            model(x).sum().backward()
            for p in model.parameters():
                p.grad = None
        return best_time(step, repeat=5, sync=sync)

    plain = timed(stack())
    model = stack()
    plan = ElixirPlan.simple(model, 1, chunk_size=8 * 8 + 8, example_batch={"input": x})
    wrapped = ElixirModule(model, plan, device=device)
    try:
        through = timed(wrapped)
    finally:
        wrapped.close()
    return max(0.0, (through - plain) / (2 * layers))


class _FlatShard:
    """An fp32 parameter shard with its gradient and AdamW moments, cut into ``pieces``
    views (one per parameter slot), updated as ``ElixirOptimizer._update`` does: the
    functional fused AdamW over the views. ``adam_rate`` and ``update_rate`` both time it."""

    def __init__(self, device: torch.device, elems: int, pieces: int) -> None:
        self.size, self.pieces = elems // pieces, pieces
        self.flat, self.grad, self.m, self.v = (torch.zeros(self.size * pieces, device=device) for _ in range(4))
        self.grad.normal_()
        self.steps = [torch.tensor(0.0, device=device) for _ in range(pieces)]
        self.fused = device.type in ("cpu", "cuda")

    @property
    def elems(self) -> int:
        return self.size * self.pieces

    def views(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t[i * self.size:(i + 1) * self.size] for i in range(self.pieces)]

    def adamw(self) -> None:
        from torch.optim.adamw import adamw as functional_adamw

        functional_adamw(self.views(self.flat), self.views(self.grad), self.views(self.m), self.views(self.v),
                         [], self.steps, foreach=None if self.fused else True, fused=self.fused,
                         amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-4, weight_decay=0.01, eps=1e-8,
                         maximize=False)


def adam_rate(device: torch.device, elems: int, sync=None) -> float:
    """Elements/s of the update the runtime runs: functional fused AdamW over views of one
    flat shard (one view per parameter slot), as ``ElixirOptimizer._update`` calls it."""
    shard = _FlatShard(device, elems, pieces=16)
    return shard.elems / best_time(shard.adamw, repeat=3, sync=sync)


def update_elems(quick: bool) -> int:
    """Elements of the flat shard ``update_rate`` is measured on: large enough to leave the
    caches, as a model's optimizer shards do."""
    return (1 if quick else 16) * 2**20


def update_rate(device: torch.device, elems: int, sync=None, before: Callable[[], object] | None = None,
                pieces: int = 64) -> float:
    """Elements/s of what ``ElixirOptimizer`` runs on a rank's fp32 shards after backward:
    the clipping norm over the gradient shard's per-parameter views and its scaling, the
    functional fused AdamW over views of one flat shard, and the zeroing of the gradient
    shard (``ComputeFigures.update_rate``). ``before`` (a barrier, when several ranks
    measure together) runs ahead of each timed update and its own time is taken off, so the
    ranks update in lock-step as they do between two all-reduces of a step."""
    shard = _FlatShard(device, elems, pieces)
    wait = before or (lambda: None)

    def update():
        wait()
        grads = shard.views(shard.grad)
        total = torch.stack([torch.linalg.vector_norm(g) for g in grads]).double().pow(2).sum().cpu()
        coef = torch.clamp(1.0 / (total.sqrt().float() + 1e-6), max=1.0).to(device)
        for g in grads:
            g.mul_(coef)
        shard.adamw()
        shard.grad.zero_()

    # with ``before``, every rank must time as many calls as the others: no time budget
    budget = math.inf if before else 3.0
    base = median_time(wait, repeat=5, sync=sync, budget=budget) if before else 0.0
    return shard.elems / max(median_time(update, repeat=5, sync=sync, budget=budget) - base, 1e-9)


# ---------------------------------------------------------------------- a transformer block
class _Block(nn.Module):
    """A GPT-style pre-norm block, the unit whose speed the cost model must get right."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class _MiniLM(nn.Module):
    """Embedding, one block, the LM head and the loss: the pieces of a causal LM's step."""

    def __init__(self, vocab: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.block = _Block(hidden, heads)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        labels = input_ids if labels is None else labels
        logits = self.head(self.norm(self.block(self.embed(input_ids))))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def step_work(model: nn.Module, batch_shape: tuple[int, int], target: str):
    """The forward and backward of ``model`` on a ``batch_shape`` batch of ``input_ids``, as
    the profiler prices it on the meta device (one ``EventWork`` for the whole step)."""
    meta = set_training(build_meta_model(model))
    vocab = getattr(getattr(meta, "config", None), "vocab_size", None)
    batch = make_batch(batch_shape, vocab, device="meta")
    work = EventWork()
    tracker = LiveStorageTracker()
    tracker.on_op = work.add
    with SDPAKernelMode(target), tracker:
        loss_of(meta(**batch)).backward()
    return work


#: causal-LM shapes (batch, seq, hidden, heads, vocab) the efficiency is measured at, one per
#: width; a CPU skips those whose matmuls would take too long
_LM_SHAPES = [(4, 128, 128, 4, 8192), (4, 128, 256, 4, 8192), (2, 128, 384, 6, 32000),
              (4, 256, 512, 8, 8192), (2, 128, 768, 12, 32000), (4, 512, 1024, 16, 32000),
              (4, 512, 2048, 16, 32000), (2, 1024, 4096, 32, 32000)]
_LM_SHAPES_QUICK = [(4, 128, 128, 4, 8192), (2, 128, 384, 6, 8192)]


def block_efficiency(figs: ComputeFigures, device: torch.device, sync=None,
                     quick: bool = False) -> list[list[float]]:
    """Measured over priced time of a small causal LM's forward and backward, by width:
    what per-operator prices miss, such as autograd's own work and narrow matmuls' lower
    rate. Measured as a median step, since that is what the prediction is compared with."""
    curve = []
    for b, s, h, heads, vocab in (_LM_SHAPES_QUICK if quick else _LM_SHAPES):
        if device.type == "cpu" and 6 * b * s * h * (12 * h + vocab) > 1e11:
            continue  # over a second per step on a one-thread CPU rank
        torch.manual_seed(0)
        model = _MiniLM(vocab, h, heads).to(device)
        ids = torch.randint(0, vocab, (b, s), device=device)

        def step():
            model(ids).backward()
            for p in model.parameters():
                p.grad = None

        measured = median_time(step, sync=sync)
        priced = price(step_work(model, (b, s), device.type), figs, "float32", efficiency=1.0)
        curve.append([float(h), measured / priced])
    return curve


# ---------------------------------------------------------------------- two ranks at once
@dataclass
class PairResult:
    """What the two-process half of the calibration measured (rank 0's view)."""

    compute: dict
    gather: tuple[float, float]   # (bandwidth B/s, latency s) of Collectives.all_gather
    reduce: tuple[float, float]   # the same for Collectives.reduce_scatter_accumulate
    overlap: dict = field(default_factory=dict)  # CPU ranks: ``comm_overlap`` by kind


#: the stack of blocks (batch, seq, hidden, heads, blocks) the collectives run beside in
#: ``comm_overlap``, one collective of ``_OVERLAP_ELEMS`` started before every block
_OVERLAP_SHAPE = (2, 128, 512, 8, 8)
_OVERLAP_SHAPE_QUICK = (2, 128, 256, 4, 4)
_OVERLAP_ELEMS = 2**23


def comm_overlap(coll, quick: bool = False, repeat: int = 7) -> dict[str, float]:
    """Share of the runtime's collectives (chunk gather, gradient reduction) that hides
    behind compute running beside them on the same rank; collective on every rank.

    A stack of transformer blocks runs forward three ways: alone; with a collective started
    before every block and waited for at once; and with each collective left running
    beside the block after it (as the runtime's prefetch leaves a gather, and its
    backward a reduction). The share is what running beside saved over what could hide:
    the collectives' cost when waited for, or the blocks' time where that is shorter. On a
    CPU whose cores all run ranks the collectives need those cores too: gloo's all-reduce
    adds on the CPU, and a broadcast copies through the kernel, so less than all of it hides."""
    import torch.distributed as dist

    b, s, h, heads, depth = _OVERLAP_SHAPE_QUICK if quick else _OVERLAP_SHAPE
    n = _OVERLAP_ELEMS // (4 if quick else 1)
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block(h, heads) for _ in range(depth))
    x = torch.randn(b, s, h)
    fulls = [torch.zeros(n) for _ in range(depth)]
    shard = torch.ones(n // coll.world_size)
    target = torch.zeros(n // coll.world_size)
    scratch = torch.empty(n // coll.world_size) if coll.reduce_needs_scratch else None
    starts = {"gather": lambda full, beside: coll.all_gather(full, shard, async_op=beside),
              "reduce": lambda full, beside: coll.reduce_scatter_accumulate(target, full, scratch, async_op=beside)}

    def run(start, beside: bool | None) -> None:
        y, pending = x, None
        for i, block in enumerate(blocks):
            if beside is not None:
                if pending is not None:
                    pending.wait()
                pending = start(fulls[i], beside)
            y = block(y)
        if pending is not None:
            pending.wait()

    out = {}
    with torch.no_grad():
        for kind, start in starts.items():
            times: dict = {None: [], False: [], True: []}
            for _ in range(2 if quick else repeat):
                for beside, got in times.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    run(start, beside)
                    got.append(time.perf_counter() - t0)
            # paired within each round (a drift of the machine falls on all three alike); each
            # collective can hide behind at most the block beside it
            saved = statistics.median(w - o for w, o in zip(times[False], times[True]))
            could = statistics.median(min(w - p, p) for w, p in zip(times[False], times[None]))
            out[kind] = min(1.0, max(0.0, saved / could)) if could > 0 else 0.0
    return out


def _pair_worker(rank: int, world: int, port: int, quick: bool, backend: str, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if backend == "nccl" else None
    figs = None
    if backend == "gloo":  # CPU ranks: compute figures with both ranks busy, one thread each
        # (before the group exists: the runtime's hooks are measured on a one-rank module)
        figs = measure_compute(dev, quick=quick, threads=1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        coll = Collectives.create(device=dev)
        # up to the largest chunks a plan uses (hundreds of MB): large buffers cost more than
        # their bytes on gloo, which stages them through fresh allocations
        sizes = [2**18, 2**20] if quick else [2**18, 2**20, 2**22, 2**24, 2**26]
        g_pts, r_pts = [], []
        for n in sizes:
            full = torch.zeros(n, device=dev)
            shard = torch.ones(n // world, device=dev)
            target = torch.zeros(n // world, device=dev)
            scratch = torch.empty(n // world, device=dev) if coll.reduce_needs_scratch else None

            def gather():
                dist.barrier()
                coll.all_gather(full, shard)

            def reduce():
                dist.barrier()
                coll.reduce_scatter_accumulate(target, full, scratch)

            def barrier():
                dist.barrier()

            base = best_time(barrier, repeat=5, sync=sync)
            wire = n * 4 * (world - 1) / world
            g_pts.append((wire, best_time(gather, repeat=3, sync=sync) - base))
            r_pts.append((wire, best_time(reduce, repeat=3, sync=sync) - base))
        overlap = {}
        if figs is not None:  # the ranks' post-backward work, in lock-step as in a step
            figs.update_rate = update_rate(dev, update_elems(quick), sync, before=dist.barrier)
            overlap = comm_overlap(coll, quick)
        if rank == 0:
            out.put(PairResult(compute=asdict(figs) if figs else {}, gather=_fit(g_pts), reduce=_fit(r_pts),
                               overlap=overlap))
    finally:
        dist.destroy_process_group()


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(bandwidth, latency) of t = latency + bytes / bandwidth, least squares."""
    xs, ys = [p[0] for p in points], [max(p[1], 1e-7) for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:  # noise on tiny buffers: take the largest buffer's rate, no latency
        return xs[-1] / ys[-1], 0.0
    latency = max(0.0, my - slope * mx)
    return 1.0 / slope, latency


def run_then_freeze(worker: Callable, *args) -> None:
    """A spawned rank's target: ``worker(*args)``, then its objects frozen out of the cycle
    collections of the interpreter's teardown (the rank's results are on the queue; those
    collections walk everything torch made, about a second of each rank's exit). The
    benchmarks' ranks use it too; ``integrations.process_exit.freeze_for_teardown`` is the
    same step for processes that end by themselves (a layer above, so not shared)."""
    worker(*args)
    gc.collect()
    gc.freeze()


def run_local_ranks(worker: Callable, args: tuple, ranks: int, timeout: float,
                    cpu: bool = True) -> tuple[object | None, list[int | None]]:
    """Run ``worker(rank, ranks, port, *args, queue)`` in ``ranks`` spawned processes on this
    machine (``port`` free for their process group; CPU ranks start as ``hf-elixir launch``
    starts them); what rank 0 put on the queue (None when nothing) and the exit codes."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=run_then_freeze, args=(worker, r, ranks, port, *args, q)) for r in range(ranks)]
    with spawning_cpu_ranks(enabled=cpu):
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    return (None if q.empty() else q.get()), [p.exitcode for p in procs]


def measure_pair(quick: bool = False, timeout: float = 120.0) -> PairResult | None:
    """Run ``_pair_worker`` in two processes; None when no pair can be made (one GPU)."""
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < 2:
        return None
    backend = "nccl" if cuda else "gloo"
    result, codes = run_local_ranks(_pair_worker, (quick, backend), 2, timeout, cpu=backend == "gloo")
    if result is None:
        warnings.warn(f"hf_elixir calibrate: the two-process measurement failed (exit codes {codes}); "
                      "collectives and per-rank compute keep their previous figures", stacklevel=2)
    return result
