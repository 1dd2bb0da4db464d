"""Long-context levers: each block's activation policy, logits in pieces, the MLP in tiles.

At long sequence lengths activations and logits, not parameters, fill the device. This
module prices, from the traced step cut at its blocks (``profile.blocks``), every
combination the search offers:

- a policy per block (``record.BLOCK_POLICIES``): ``keep`` (its activations stay on the
  device), ``recompute`` (checkpointing: only its input stays), ``recompute_offload`` (its
  input waits in pinned host memory and comes back ahead of its recomputation), ``offload``
  (every activation its backward needs waits in host memory; no recomputation); the first
  blocks are offloaded (their backward comes last, so their copies have the most time);
- ``logit_piece_tokens``: the LM head and the loss run over pieces of the sequence, so one
  piece's logits and their gradient exist at a time instead of the whole;
- the MLP over sequence tiles (its rise above what was alive when it began divided by the
  tile count, plus its input's gradient, which stays whole).

Memory. The device holds, at each instant the trace has, what the checkpointed (or plain)
pass held then, with each block's share replaced by its policy's: a kept block its whole
saved activations, a recomputed one its input, an offloaded one nothing but while in flight.
An offloaded block is in flight while the next block runs forward (its copy out overlaps
that block) and from the prefetch during the next block's backward until its own backward
ends: so at most two blocks' offloaded bytes are on the device at once. The peak is the most
of every block's forward, the head, every block's backward and what follows the blocks.
With every block recomputed, no pieces and no tiles it is the checkpointed trace's own peak.

Time, against the step of the same kind the search priced (checkpointed for blocks that
recompute, plain for blocks that do not): an offloaded block pays what of its copy (at the
host link's bandwidth) does not hide behind the neighbouring block's compute, once out in
forward and once back in backward; pieces pay the head's forward again (the logits are
recomputed piece by piece in backward) and the head's operator calls once more per extra
piece; tiles pay the MLP's operator calls once more per extra tile. Every lever only adds
time, so a combination is chosen only where the step it changes does not fit. Kept and
recomputed blocks are not mixed: what recomputation saves beside the gathers and reductions
it overlaps at several ranks is the simulation's to say (``cost.simulate``), not a
difference of compute times.

Host memory: every offloaded byte is pinned host memory for the whole step (the search adds
it to the host budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from hf_elixir.planner import cost
from hf_elixir.vocab import DTYPE_BYTES
from hf_elixir.planner.candidate import Candidate, chain, describe_runs, runs
from hf_elixir.profile.blocks import MLP_NAMES, PassBlocks, Stretch, block_figures

#: MLP tile counts tried (1: the MLP runs whole)
MLP_TILES = (1, 2, 4, 8, 16)
#: the smallest logit piece tried, in tokens; pieces are powers of two up to half the sequence
MIN_PIECE = 1024


@dataclass(frozen=True)
class Levers:
    """One combination: a policy per block, the logit piece (0: whole) and the MLP tiles."""

    policies: tuple[str, ...]
    logit_piece_tokens: int = 0
    mlp_tiles: int = 1


@dataclass(frozen=True)
class Priced:
    """What a combination costs: the activation peak, the step time beside the
    all-recompute step (negative when it saves recomputation), how much of that is copies
    not hidden, and the pinned host bytes."""

    levers: Levers
    peak: float
    extra_time: float
    exposed_copies: float
    compute_change: float
    pinned_bytes: float
    copied_bytes: float


@dataclass
class ActivationModel:
    """The step's activation memory and time per combination (see the module docstring).

    Attributes:
        ckpt, plain: the two traced passes cut at their blocks.
        ckpt_times, plain_times: per event of each pass, its priced seconds.
        seq_len: the profiled sequence length (logit pieces are counted in its tokens).
        h2d, d2h: the host link's bandwidths, B/s (0: the device is the host, no copies).
        op_overhead: seconds per operator call (what an extra MLP tile pays per operator).
        op_counts: per event of the checkpointed pass, its operator calls.
        pieces_supported: whether the head is a causal-LM head the runtime can run in pieces.
        tiles_supported: whether the runtime can tile the blocks' MLPs (not where an MLP
            routes tokens: a fetch unit, which ``runtime/mlp_tiles.py`` refuses to tile).
        vocab: the head's outputs per token (0: unknown, pieces not offered).
        tokens: the tokens one step scores (batch × sequence): a piece is that many at most.
        compute_bytes: bytes of one element in the compute dtype (the logits' dtype).
        head_grad_numel: elements of the head's weight when it trains (0 when it is frozen,
            as under LoRA): backward then sums its gradient over the pieces.
    """

    ckpt: PassBlocks
    plain: PassBlocks
    ckpt_times: Sequence[float]
    plain_times: Sequence[float]
    seq_len: int
    h2d: float
    d2h: float
    op_overhead: float
    op_counts: Sequence[int]
    pieces_supported: bool = True
    tiles_supported: bool = True
    vocab: int = 0
    tokens: int = 0
    compute_bytes: int = 4
    head_grad_numel: int = 0
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return len(self.ckpt.blocks)

    @property
    def hidden_bytes(self) -> int:
        """One hidden state's bytes: what a recomputed block holds (its output)."""
        return max(b.held for b in self.ckpt.blocks)

    # ------------------------------------------------------------------ memory
    def _held(self, i: int, policy: str) -> float:
        if policy == "keep":
            return self.plain.blocks[i].held
        if policy == "recompute":
            return self.ckpt.blocks[i].held
        return 0.0

    @property
    def shared_inputs(self) -> float:
        """Bytes every block reads beside the hidden state (the rotary tables, position
        ids): alive before the first block, beyond its input. Each offloaded block's group
        holds them too (the runtime copies what one call of the block saves), so they travel
        with every offloaded block."""
        return max(0.0, self.ckpt.before - self.hidden_bytes)

    def _moving(self, i: int, policy: str) -> float:
        """Bytes of block ``i`` that travel to the host and back (0 unless offloaded)."""
        if policy == "recompute_offload":
            return self.ckpt.blocks[i].held + self.shared_inputs
        if policy == "offload":
            return self.plain.blocks[i].held + self.shared_inputs
        return 0.0

    def _stretch_top(self, s: Stretch, tiles: int) -> float:
        if tiles <= 1 or not s.has_mlp:
            return s.rise
        return max(s.other_rise, s.mlp_start + s.mlp_rise / tiles + self.hidden_bytes)

    def blocks_peak(self, policies: tuple[str, ...], tiles: int) -> float:
        """The most bytes alive during any block's forward or backward."""
        base = self.ckpt.before
        top = 0.0
        below = 0.0
        for i, pol in enumerate(policies):
            recomputed = pol in ("recompute", "recompute_offload")
            cut = self.ckpt if recomputed else self.plain
            blk = cut.blocks[i]
            t = tiles if recomputed else 1
            # in forward the block before's group is still on the device, being copied out
            # (the tensors themselves, not copies: the shared inputs are in ``base``)
            out = self._moving(i - 1, policies[i - 1]) - self.shared_inputs if i else 0.0
            fwd = base + below + max(0.0, out) + self._stretch_top(blk.forward, t)
            # in backward its own group is back (or never left) and the one below comes up,
            # each with its copy of the shared inputs
            own = self._moving(i, pol) or blk.held
            up = self._moving(i - 1, policies[i - 1]) if i else 0.0
            bwd = base + cut.backward_base + below + own + up + self._stretch_top(blk.backward, t)
            top = max(top, fwd, bwd)
            below += self._held(i, pol)
        return top

    def head_peak(self, policies: tuple[str, ...], piece: int) -> float:
        """The most bytes alive while the head and the loss run (forward and backward)."""
        held = sum(self._held(i, p) for i, p in enumerate(policies))
        last = self._moving(self.n - 1, policies[-1])
        # the head's stretch of the pass its last block follows; with both kinds, the larger
        recomputes = any(p in ("recompute", "recompute_offload") for p in policies)
        rise = max(self.ckpt.head_rise, self.plain.head_rise) if recomputes else self.plain.head_rise
        if piece:
            rise = self.pieces_rise(piece)
        return self.ckpt.before + held + last + rise

    def pieces_rise(self, piece: int) -> float:
        """What ``runtime/logit_pieces.py`` holds above the last block while the head and
        the loss run in pieces of ``piece`` scored tokens, counted from what it allocates
        (not scaled from the whole head's rise, which holds three logit-sized tensors):
        - one piece's logits in the compute dtype beside an fp32 tensor of the same shape
          (the log-softmax in forward, the softmax and the logits' gradient in backward),
          plus the fp32 copy of the logits the loss makes when they are not fp32 already;
        - two whole hidden states: the final norm's output (the head's input) and its
          gradient, which the pieces fill;
        - when the head's weight trains, its gradient's fp32 sum and one more tensor of the
          weight's shape: one piece's product before it is added in (fp32; seen at the peak
          of bench_long_context on a CPU) or the sum cast to a lower compute dtype."""
        elements = min(piece, self.tokens or piece) * self.vocab
        per_element = self.compute_bytes + 4 + (4 if self.compute_bytes != 4 else 0)
        weight = self.head_grad_numel * (4 + self.compute_bytes)
        return elements * per_element + 2 * self.hidden_bytes + weight

    def peak(self, levers: Levers) -> float:
        tail = max(self.ckpt.tail_top, self.plain.tail_top)
        return max(self.blocks_peak(levers.policies, levers.mlp_tiles),
                   self.head_peak(levers.policies, levers.logit_piece_tokens), tail)

    # ------------------------------------------------------------------ time
    def _t(self, times: Sequence[float], events: Sequence[int]) -> float:
        return sum(times[e] for e in events)

    def _neighbour_times(self, i: int, recomputed: bool) -> tuple[float, float]:
        """(forward, backward) seconds of what runs after block ``i`` in forward (and so
        before it in backward): the next block, or the head."""
        pb, times = (self.ckpt, self.ckpt_times) if recomputed else (self.plain, self.plain_times)
        if i + 1 < self.n:
            nxt = pb.blocks[i + 1]
            return self._t(times, nxt.forward.events), self._t(times, nxt.backward.events)
        head = self._t(times, pb.head_events)
        return head / 2, head / 2

    def time_change(self, levers: Levers) -> tuple[float, float, float, float]:
        """(compute change, exposed copy seconds, pinned bytes, bytes copied each way), beside
        the step of the same kind (blocks that recompute: the checkpointed step; blocks
        that do not: the plain one), which the combination is priced against."""
        compute = exposed = pinned = 0.0
        for i, pol in enumerate(levers.policies):
            moving = self._moving(i, pol)
            if moving and self.h2d > 0:
                fwd, bwd = self._neighbour_times(i, pol == "recompute_offload")
                exposed += max(0.0, moving / self.d2h - fwd) + max(0.0, moving / self.h2d - bwd)
                pinned += moving
            elif moving:
                pinned += moving
        if levers.logit_piece_tokens:
            # the logits' forward once more, and the head's operator calls once per piece
            compute += self._t(self.ckpt_times, self.ckpt.head_events) / 2
            pieces = -(-self.seq_len // levers.logit_piece_tokens)
            calls = sum(self.op_counts[e] for e in self.ckpt.head_events)
            compute += (pieces - 1) * calls * self.op_overhead
        if levers.mlp_tiles > 1:
            for i, pol in enumerate(levers.policies):
                if pol in ("recompute", "recompute_offload"):
                    blk = self.ckpt.blocks[i]
                    calls = sum(self.op_counts[e] for e in blk.forward.mlp_events + blk.backward.mlp_events)
                    compute += (levers.mlp_tiles - 1) * calls * self.op_overhead
        return compute, exposed, pinned, pinned

    def price(self, levers: Levers) -> Priced:
        compute, exposed, pinned, copied = self.time_change(levers)
        return Priced(levers, self.peak(levers), compute + exposed, exposed, compute, pinned, copied)

    # ------------------------------------------------------------------ the options
    def options(self, recomputing: bool, offload: bool) -> list[Priced]:
        """The combinations worth offering beside one kind of step, as a front: walking up
        from the smallest peak, each is faster than every one below it, or as fast and
        copies less.

        ``recomputing``: beside the checkpointed step, the first blocks' inputs offloaded
        (``recompute_offload``), the rest recomputed, each with logit pieces and MLP tiles;
        beside the plain step, the first blocks' activations offloaded (``offload``), the
        rest kept, each with logit pieces. Both only add time to the step they change, so
        a combination is chosen only where its step does not fit. ``offload``: whether a
        host link exists (on a CPU device the host is the device: no offload policies)."""
        n = self.n
        kinds = ("recompute_offload", "recompute") if recomputing else ("offload", "keep")
        policies = [(kinds[0],) * k + (kinds[1],) * (n - k) for k in (range(n + 1) if offload else [0])]
        pieces = [0]
        if self.pieces_supported:
            p = MIN_PIECE
            while p * 2 <= self.seq_len:
                pieces.append(p)
                p *= 2
        has_mlp = any(b.backward.has_mlp for b in self.ckpt.blocks)
        tiles = MLP_TILES if has_mlp and recomputing and self.tiles_supported else (1,)
        tail = max(self.ckpt.tail_top, self.plain.tail_top)
        priced: list[Priced] = []
        for pol in policies:
            blocks = {t: self.blocks_peak(pol, t) for t in tiles}
            heads = {p: self.head_peak(pol, p) for p in pieces}
            for t, top in blocks.items():
                for p, head in heads.items():
                    if pol[0] == kinds[1] and not p and t == 1:
                        continue  # the search's own step of this kind
                    lv = Levers(pol, p, t)
                    compute, exposed, pinned, copied = self.time_change(lv)
                    priced.append(Priced(lv, max(top, head, tail), compute + exposed, exposed, compute,
                                         pinned, copied))
        # as the search's chain ranks (time, then bytes moved): at one time, fewer blocks
        # offloaded is worth more memory
        front: list[Priced] = []
        for o in sorted(priced, key=lambda o: (o.peak, o.extra_time, o.copied_bytes)):
            if not front or (o.extra_time, o.copied_bytes) < (front[-1].extra_time, front[-1].copied_bytes):
                front.append(o)
        return front


def model_of(profile, ckpt_times: Sequence[float], plain_times: Sequence[float], h2d: float, d2h: float,
             op_overhead: float) -> ActivationModel | None:
    """The activation model of a profile (None when its passes cannot be cut at blocks:
    no decoder blocks found, no checkpointing, or blocks that do not run in order)."""
    path = profile.extra.get("block_path")
    if not path or profile.checkpointed is None:
        return None
    ck = block_figures(profile.checkpointed.trace, path)
    pl = block_figures(profile.plain.trace, path)
    if ck is None or pl is None or len(ck.blocks) != len(pl.blocks) or len(ck.blocks) < 2:
        return None
    counts = [w.ops for w in profile.checkpointed.trace.work]
    routed = any(set(u.split(".")) & set(MLP_NAMES) for u in profile.fetch_units)  # a routed MLP
    vocab = profile.extra.get("vocab_size") or 0
    return ActivationModel(ck, pl, ckpt_times, plain_times, profile.seq_len, h2d, d2h, op_overhead, counts,
                           pieces_supported=bool(vocab), tiles_supported=not routed, vocab=vocab,
                           tokens=profile.batch_size * profile.seq_len,
                           compute_bytes=DTYPE_BYTES[profile.dtype], head_grad_numel=_head_grad_numel(profile, vocab))


def _head_grad_numel(profile, vocab: int) -> int:
    """Elements of the LM head's weight when it trains, else 0. The head is the last
    parameter with one row per vocabulary entry (Transformers registers the head after the
    blocks; a tied head is the embedding, listed once)."""
    heads = [p for p in profile.params if len(p.shape) == 2 and vocab and p.shape[0] == vocab]
    return 0 if not heads or heads[-1].frozen else heads[-1].numel


def variants(cands: list[Candidate], model: ActivationModel, offload: bool,
             margin_of: Callable[[float], float]) -> list[Candidate]:
    """The candidates on the budget-independent chain of each kind of step (checkpointed,
    plain), each with each combination of ``model.options`` for that kind in place of its
    activations (see the module docstring). ``margin_of``: the allocator margin for a total
    (``cost.memory``'s rule)."""
    out: list[Candidate] = []
    for recomputing in (True, False):
        base = chain([c for c in cands if c.checkpointing == recomputing and not c.policies])
        opts = model.options(recomputing, offload)
        for c in base:
            out += [_with(c, o, margin_of) for o in opts]
    return out


def _with(c: Candidate, o: Priced, margin_of: Callable[[float], float]) -> Candidate:
    """Candidate ``c`` with the combination ``o`` in place of its activations."""
    mem = dict(c.memory)
    # the gradient buffers at their own peak, not at the activations' (an upper bound:
    # the combination's activations peak elsewhere than the trace's)
    settled = (mem.get("parameters", 0) + mem.get("frozen_shards", 0) + mem.get("master_weights", 0)
               + mem.get("optimizer_state", 0) + mem.get("rcache", 0) + mem.get("gradients", 0))
    grads = mem.get("gradients", 0) + max(0, c.ledger_peak - settled)
    m = dict(mem, activations=int(o.peak), gradients=int(grads), margin=0)
    rest = sum(v for k, v in m.items() if k != "margin")
    m["margin"] = int(margin_of(rest))
    t = dict(c.time)
    t["compute"] = t.get("compute", 0.0) + o.compute_change
    t["forward_backward"] = t.get("forward_backward", 0.0) + o.extra_time
    t["exposed_activation_copies"] = o.exposed_copies
    t["step"] = c.step_time + o.extra_time
    return replace(c, peak=float(rest + m["margin"]), step_time=c.step_time + o.extra_time, memory=m, time=t,
                   pcie_bytes=c.pcie_bytes + 2 * o.copied_bytes, policies=o.levers.policies,
                   logit_piece_tokens=o.levers.logit_piece_tokens, mlp_tiles=o.levers.mlp_tiles,
                   pinned_bytes=o.pinned_bytes)


def of_profile(cands: list[Candidate], profile, priced: dict[bool, list[float]], hw, figs,
               context: float) -> list[Candidate]:
    """The search's variants for one profile: ``variants`` with the profile's model, priced
    at the hardware's host link; none when the profile cannot be cut at blocks, and none on
    a CPU device (there the host is the device, and the CPU runtime's plans keep their
    uniform steps)."""
    if hw.device_type != "cuda":
        return []
    model = model_of(profile, priced.get(True, []), priced[False], hw.h2d_bandwidth, hw.d2h_bandwidth,
                     figs.op_overhead)
    if model is None:
        return []
    frac = cost.allocator_margin(hw)
    return variants(cands, model, offload=True, margin_of=lambda rest: frac * rest + context)


def block_policies(c: Candidate, path: str) -> dict[str, str]:
    """The plan's ``block_policies`` for candidate ``c``: each block's module name (under
    ``path``, ``model.layers``) and its policy, or nothing when every block follows
    ``activation_checkpointing``."""
    if not c.policies:
        return {}
    return {f"{path}.{i}": p for i, p in enumerate(c.policies)}


def predictions(c: Candidate) -> dict[str, Any]:
    """What the plan says about its long-context levers, for the summary and a reader of
    the JSON: ``{"long_context": ...}``, or nothing when the candidate uses none."""
    if not (c.policies or c.logit_piece_tokens or c.mlp_tiles > 1):
        return {}
    return {"long_context": {
        "block_policy_runs": [[a, b, p] for a, b, p in runs(c.policies)],
        "logit_piece_tokens": c.logit_piece_tokens,
        "mlp_tiles": c.mlp_tiles,
        "pinned_activation_bytes": int(c.pinned_bytes),
        "activation_bytes": int(c.memory.get("activations", 0)),
    }}


__all__ = ["ActivationModel", "Levers", "MIN_PIECE", "MLP_TILES", "Priced", "block_policies", "describe_runs",
           "model_of", "of_profile", "predictions", "runs", "variants"]
