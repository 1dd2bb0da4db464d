"""Profile a deep model by tracing a few of its layers and unfolding the result.

A transformer repeats one decoder layer N times, and the step of the N-layer model is the
step of a short model with the middle layer repeated: the same operators, the same fetches,
and per layer the same bytes saved for backward. Tracing every layer of a 70B model on the
meta device takes many seconds (two passes, 80 layers, every operator through Python), so
the profiler traces a model ``TRACED`` layers deep and unfolds its profile to N layers
instead: layer 1's stretch of the trace is repeated for layers 1..N-2, with layer indices
renamed and the live bytes raised by one layer's saved activations per layer below.

Nothing here is assumed, everything is checked. A model is folded only when:

- its config says how deep it is (``num_hidden_layers``) and every per-layer list in the
  config (``layer_types``) is the same for all layers;
- its layers are one ``nn.ModuleList`` whose parameters are contiguous, with no parameter
  tied across the stack;
- inside a traced profile, each middle layer's stretch is layer 1's renamed and raised by
  one layer's bytes per layer, forward and backward, in both passes;
- and unfolding the ``TRACED``-layer profile to ``TRACED + 1`` layers gives exactly the
  profile traced from a ``TRACED + 1``-layer model: parameters, buffers, fetch units,
  borrowed reads, events, per-event work and live bytes, pins, peaks and FLOPs.

Anything else (interleaved layer kinds, a mixture-of-experts block every k layers,
parameters whose shape depends on depth) fails a check, and the caller traces the whole
model: folding changes how long profiling takes, never what it finds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence, TypeVar

from torch import nn

from hf_elixir.profile.lora import decoder_blocks
from hf_elixir.profile.trace import Trace, build_meta_model

#: layers the folded profile is traced with (the first, one middle layer, the last); the
#: check traces a model one layer deeper, whose two middle layers are compared too
TRACED = 3
#: models shallower than this are traced whole (folding would save little)
MIN_LAYERS = 8

T = TypeVar("T")


class NoFold(Exception):
    """The model's profile is not a repetition of one layer: trace it whole."""


@dataclass(frozen=True)
class LayerStack:
    """Where a model's decoder layers live, by module path (``model.layers``)."""

    path: str

    def index(self, name: str) -> int | None:
        """The layer a module or parameter name belongs to, or None outside the stack."""
        if not name.startswith(self.path + "."):
            return None
        head = name[len(self.path) + 1:].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def shift(self, name: str, by: int) -> str:
        """``name`` moved ``by`` layers deeper (names outside the stack are kept)."""
        i = self.index(name)
        if i is None or by == 0:
            return name
        tail = name[len(self.path) + 1 + len(str(i)):]
        return f"{self.path}.{i + by}{tail}"


# ---------------------------------------------------------------------- truncated models
def layer_count(config: Any) -> int | None:
    n = getattr(config, "num_hidden_layers", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def truncated_config(config: Any, layers: int) -> Any:
    """A copy of ``config`` with ``layers`` decoder layers (see ``_shorten``)."""
    short = copy.deepcopy(config)
    _shorten(short, layers)
    return short


def _shorten(config: Any, layers: int) -> None:
    """Give ``config`` ``layers`` decoder layers, in place; per-layer lists are cut to match
    (refused unless every layer's entry is the same: the cut would change the kind of layer
    the trace sees)."""
    n = layer_count(config)
    if n is None:
        raise NoFold("the config does not say how many layers the model has")
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == n and n > 1:
            if any(v != value[0] for v in value):
                raise NoFold(f"config.{key} differs between layers")
            setattr(config, key, type(value)(value[:layers]))
    config.num_hidden_layers = layers
    if layer_count(config) != layers:
        raise NoFold("the config's layer count cannot be set")


def truncated_meta_model(model: nn.Module, dtype: str, layers: int, total: int) -> nn.Module:
    """A meta copy of ``model`` keeping its first ``layers`` decoder layers of ``total``
    (the rest are never copied), its config shortened to match."""
    found = decoder_blocks(model)
    config = getattr(model, "config", None)
    if found is None or len(found[1]) != total or config is None:
        raise NoFold("the model's decoder layers are not as many as its config says")
    path, blocks = found
    meta = build_meta_model(model, dtype, leave_out=list(blocks)[layers:])
    copied = meta.get_submodule(path)
    for j in range(layers, total):
        del copied._modules[str(j)]
    if meta.config is config:
        raise NoFold("the copy shares the model's config")
    _shorten(meta.config, layers)
    return meta


def find_stack(model: nn.Module, layers: int) -> LayerStack:
    """The model's decoder layers (``profile.lora.decoder_blocks``), which must number
    ``layers``."""
    found = decoder_blocks(model)
    if found is None or len(found[1]) != layers:
        raise NoFold("no list of decoder layers as long as the config says")
    return LayerStack(found[0])


# ---------------------------------------------------------------------- unfolding
def _expand(items: Sequence[T], name_of: Callable[[T], str], moved: Callable[[T, int], T],
            stack: LayerStack, traced: int, layers: int) -> list[T]:
    """Items of a ``traced``-layer model, in order, as the ``layers``-layer model has them:
    layer 1's items repeated for layers 1..layers-2, layers 2..traced-2 dropped (they repeat
    layer 1), the last layer's moved to the last place. Each layer's items must be one
    contiguous run."""
    runs: list[tuple[int | None, list[T]]] = []
    for item in items:
        i = stack.index(name_of(item))
        if runs and runs[-1][0] == i:
            runs[-1][1].append(item)
        else:
            runs.append((i, [item]))
    seen = [i for i, _ in runs if i is not None]
    if len(seen) != len(set(seen)):
        raise NoFold("a layer's entries are not contiguous")
    out: list[T] = []
    for i, run in runs:
        if i is None or i == 0:
            out.extend(run)
        elif i == 1:
            for by in range(layers - 2):
                out.extend(moved(item, by) for item in run)
        elif i == traced - 1:
            out.extend(moved(item, layers - traced) for item in run)
    return out


def _expand_map(mapping: dict[str, T], moved_value: Callable[[T, int], T], stack: LayerStack,
                traced: int, layers: int) -> dict[str, T]:
    pairs = _expand(list(mapping.items()), lambda kv: kv[0],
                    lambda kv, by: (stack.shift(kv[0], by), moved_value(kv[1], by)), stack, traced, layers)
    return dict(pairs)


@dataclass
class _Segment:
    """A stretch of a trace: its events (with work and live bytes) and the pins made while
    they ran (``at``: the event, counted from the segment's start, each pin follows)."""

    events: list[tuple[str, str]]
    work: list[Any]
    live: list[tuple[int, int]]
    pins: list[tuple[str, str]]
    at: list[int]

    def moved(self, stack: LayerStack, by: int, offset: int) -> "_Segment":
        return _Segment([(ph, stack.shift(m, by)) for ph, m in self.events], list(self.work),
                        [(a + offset, b + offset) for a, b in self.live],
                        [(k, stack.shift(m, by)) for k, m in self.pins], list(self.at))


@dataclass
class _Cut:
    """A traced step cut at each layer's first forward and first backward-side event.

    ``forward``: ``F(1)..F(traced-2)``, each from a middle layer's first forward event to
    the next layer's; ``backward``: ``G(1)..G(traced-2)``, each from a middle layer's first
    backward (or recompute) event to the layer below's. ``pre`` runs up to layer 1,
    ``tail`` from the last layer's forward to the first backward-side event (the last
    layer, the head and the loss), ``turn`` from there to layer ``traced-2``'s backward,
    ``post`` from layer 0's backward to the end. ``rise_forward`` is the bytes one layer
    adds to what is alive in forward; ``rise_backward`` what it adds in backward, which
    can be less (what forward's outputs held, a key/value cache, dies when forward ends)."""

    pre: _Segment
    forward: list[_Segment]
    tail: _Segment
    turn: _Segment
    backward: list[_Segment]
    post: _Segment
    rise_forward: int
    rise_backward: int


def _cut(trace: Trace, stack: LayerStack, traced: int) -> _Cut:
    first_fwd: dict[int, int] = {}
    first_bwd: dict[int, int] = {}
    for e, (phase, module) in enumerate(trace.events):
        i = stack.index(module)
        if i is None:
            continue
        (first_fwd if phase == "forward" else first_bwd).setdefault(i, e)
    if sorted(first_fwd) != list(range(traced)) or sorted(first_bwd) != list(range(traced)):
        raise NoFold("a layer has no forward or no backward event")
    fwd = [first_fwd[i] for i in range(traced)]
    bwd = [first_bwd[i] for i in range(traced)]
    if fwd != sorted(fwd) or bwd != sorted(bwd, reverse=True) or fwd[-1] >= bwd[-1]:
        raise NoFold("layers do not run in order")
    turn = next(e for e in range(fwd[-1], len(trace.events)) if trace.events[e][0] != "forward")
    if any(phase == "forward" for phase, _ in trace.events[turn:]) or turn > bwd[-2]:
        raise NoFold("forward and backward interleave")
    bounds = [0] + fwd[1:] + [turn] + bwd[traced - 2::-1] + [len(trace.events)]
    at = trace.pin_events
    segments = []
    for lo, hi in zip(bounds, bounds[1:]):
        # a pin belongs to the event it follows (pins made before any event, to the first)
        picked = [j for j, e in enumerate(at) if lo <= max(e - 1, 0) < hi]
        segments.append(_Segment(trace.events[lo:hi], trace.work[lo:hi], trace.live[lo:hi],
                                 [trace.pins[j] for j in picked], [at[j] - lo for j in picked]))
    middle = traced - 2
    return _Cut(pre=segments[0], forward=segments[1:1 + middle], tail=segments[1 + middle],
                turn=segments[2 + middle], backward=segments[3 + middle:3 + 2 * middle][::-1], post=segments[-1],
                rise_forward=trace.live[fwd[2]][0] - trace.live[fwd[1]][0],
                rise_backward=trace.live[bwd[2]][0] - trace.live[bwd[1]][0])


def _check_periodic(cut: _Cut, stack: LayerStack) -> None:
    """Every middle layer's stretch must be layer 1's, renamed and raised by its depth."""
    for run, rise in ((cut.forward, cut.rise_forward), (cut.backward, cut.rise_backward)):
        for by, seg in enumerate(run[1:], start=1):
            if seg != run[0].moved(stack, by, by * rise):
                raise NoFold(f"layer {by + 1}'s stretch of the trace is not layer 1's repeated")


def unfold_trace(trace: Trace, stack: LayerStack, traced: int, layers: int) -> tuple[Trace, _Cut]:
    """The trace of the ``layers``-layer model, and the cut it was unfolded from."""
    cut = _cut(trace, stack, traced)
    _check_periodic(cut, stack)
    extra = layers - traced
    f1, g1 = cut.forward[0], cut.backward[0]
    order = ([cut.pre] + [f1.moved(stack, by, by * cut.rise_forward) for by in range(layers - 2)]
             + [cut.tail.moved(stack, extra, extra * cut.rise_forward),
                cut.turn.moved(stack, extra, extra * cut.rise_backward)]
             + [g1.moved(stack, by, by * cut.rise_backward) for by in range(layers - 3, -1, -1)] + [cut.post])
    out = Trace(module_params=_expand_map(trace.module_params, lambda ps, by: [stack.shift(p, by) for p in ps],
                                          stack, traced, layers),
                module_flops=_expand_map(trace.module_flops, lambda f, by: f, stack, traced, layers))
    for seg in order:
        base = len(out.events)
        out.events.extend(seg.events)
        out.work.extend(seg.work)
        out.live.extend(seg.live)
        out.pins.extend(seg.pins)
        out.pin_events.extend(base + a for a in seg.at)
    return out, cut


def unfold_pass(step: Any, stack: LayerStack, traced: int, layers: int) -> Any:
    """A ``PassProfile`` of the ``traced``-layer model unfolded to ``layers`` layers."""
    trace, cut = unfold_trace(step.trace, stack, traced, layers)
    extra = layers - traced
    forward_flops = sum(w.flops for w in cut.forward[0].work)
    layer_flops = forward_flops + sum(w.flops for w in cut.backward[0].work)
    mem = step.memory
    top_before = max((b for _, b in step.trace.live), default=0)
    top_after = max((b for _, b in trace.live), default=0)
    memory = replace(
        mem,
        peak=max(top_after, mem.peak if mem.peak > top_before else 0),
        forward_peak=mem.forward_peak + extra * cut.rise_forward,
        saved=mem.saved + extra * cut.rise_backward,
        flops=type(mem.flops)(mem.flops + extra * layer_flops),
        forward_flops=type(mem.forward_flops)(mem.forward_flops + extra * forward_flops),
        extra=dict(mem.extra),
    )
    return replace(step, trace=trace, memory=memory)


def unfold_profile(profile: Any, stack: LayerStack, traced: int, layers: int, layer_buffer_bytes: int) -> Any:
    """A ``ModelProfile`` of the ``traced``-layer model unfolded to ``layers`` layers."""
    if any(stack.index(name) is not None for group in profile.tied for name in group):
        raise NoFold("a parameter is tied across the stack")
    params = _expand(profile.params, lambda p: p.name, lambda p, by: replace(p, name=stack.shift(p.name, by)),
                     stack, traced, layers)
    units = _expand(profile.fetch_units, lambda u: u, stack.shift, stack, traced, layers)
    borrowed = _expand_map(profile.borrowed, lambda ps, by: [stack.shift(p, by) for p in ps], stack, traced, layers)
    plain = unfold_pass(profile.plain, stack, traced, layers)
    ckpt = None if profile.checkpointed is None else unfold_pass(profile.checkpointed, stack, traced, layers)
    return replace(profile, params=params, fetch_units=units, borrowed=borrowed, plain=plain,
                   checkpointed=ckpt, tied=[list(g) for g in profile.tied],
                   buffer_bytes=profile.buffer_bytes + (layers - traced) * layer_buffer_bytes,
                   extra=dict(profile.extra))


#: the fields two profiles of one model must agree on (not its name, or how long it took)
COMPARED = ("params", "tied", "buffer_bytes", "fetch_units", "borrowed", "plain", "checkpointed",
            "batch_size", "seq_len", "dtype", "attention_target")


def same_profile(a: Any, b: Any) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in COMPARED)


__all__ = ["LayerStack", "MIN_LAYERS", "NoFold", "TRACED", "find_stack", "layer_count", "same_profile",
           "truncated_config", "unfold_pass", "unfold_profile", "unfold_trace"]
