"""Activation memory block by block, read off a traced step.

Long-context planning chooses, per decoder block, what happens to the activations its
backward needs (keep, recompute, recompute from an input in host memory, or keep them all
in host memory), and runs the LM head over sequence pieces. Pricing those choices needs the
traced step cut at the blocks: what each block leaves alive from its forward to its
backward, and how far its forward and its backward (with its recomputation) rise above what
was alive when they began. ``block_figures`` reads exactly that from a ``PassProfile``'s
per-event live bytes (``Trace.live``: the bytes alive when an event began and the most alive
until the next), so every figure is a difference of two measured points of the same trace,
never a formula of the model's shape.

The head (the final norm, the LM head and the loss) is the stretch between the last block's
forward and the first block's backward: its rise above what the blocks hold is the whole
logits' cost. The MLP inside a block (a child named ``mlp``, ``feed_forward`` or ``ffn``) is
marked too: run over sequence tiles, only its rise above what was alive when it began
shrinks with the tile count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_elixir.profile.fold import LayerStack

#: the names a block's position-wise MLP goes by in Transformers' decoder layers
MLP_NAMES = ("mlp", "feed_forward", "ffn")


@dataclass
class Stretch:
    """One stretch of a block (its forward, or its backward with its recomputation).

    Attributes:
        rise: the most bytes above what was alive when the stretch began.
        mlp_start: bytes alive when the MLP's run of events began, above the stretch's start
            (0 without an MLP).
        mlp_rise: the most bytes above that while the MLP ran (what sequence tiles divide).
        other_rise: the most bytes above the stretch's start outside the MLP's run.
        events: the stretch's events; mlp_events: the MLP's run among them.
    """

    rise: int
    mlp_start: int = 0
    mlp_rise: int = 0
    other_rise: int = 0
    events: list[int] = field(default_factory=list)
    mlp_events: list[int] = field(default_factory=list)

    @property
    def has_mlp(self) -> bool:
        return bool(self.mlp_events)


@dataclass
class BlockSpan:
    """One block in one traced pass.

    Attributes:
        held: bytes the block's forward leaves alive until its backward (with checkpointing,
            its output, which the next block's checkpoint keeps; without, every tensor its
            backward reads).
        forward, backward: its two stretches (the backward's includes its recomputation).
    """

    held: int
    forward: Stretch
    backward: Stretch


@dataclass
class PassBlocks:
    """A traced pass cut at its decoder blocks.

    Attributes:
        names: the blocks' module names, in forward order.
        blocks: each block's ``BlockSpan``.
        before: bytes alive when the first block's forward began (the embeddings' output,
            which is the first block's input, among them).
        head_rise: the most bytes above what was alive when the head's forward began (every
            block's held bytes), over the head's forward and backward: the logits' cost.
        backward_base: the most bytes alive at a block's backward start beyond the held bytes
            of that block and those below it (the gradient flowing in, the rotary tables).
        tail_top: the most bytes alive after the first block's backward (the embeddings').
        head_events: the head's events (forward and backward).
    """

    names: list[str]
    blocks: list[BlockSpan]
    before: int
    head_rise: int
    backward_base: int
    tail_top: int
    head_events: list[int] = field(default_factory=list)


def block_figures(trace, path: str) -> PassBlocks | None:
    """``trace`` (a ``profile.trace.Trace``) cut at the blocks under ``path``
    (``model.layers``); None when the blocks do not run in order, each forward once and each
    backward once after every forward (nothing to plan per block then)."""
    stack = LayerStack(path)
    events, live = trace.events, trace.live
    if not events or len(live) != len(events):
        return None
    fwd: dict[int, list[int]] = {}
    bwd: dict[int, list[int]] = {}
    first_backward = None
    for e, (phase, module) in enumerate(events):
        i = stack.index(module)
        if phase != "forward" and first_backward is None:
            first_backward = e
        if i is None:
            continue
        (fwd if phase == "forward" else bwd).setdefault(i, []).append(e)
    n = len(fwd)
    if n == 0 or sorted(fwd) != list(range(n)) or sorted(bwd) != list(range(n)) or first_backward is None:
        return None
    starts_f = [fwd[i][0] for i in range(n)]
    starts_b = [bwd[i][0] for i in range(n)]
    if starts_f != sorted(starts_f) or starts_b != sorted(starts_b, reverse=True):
        return None
    if any(max(fwd[i]) >= starts_f[i + 1] for i in range(n - 1)) or max(fwd[n - 1]) >= first_backward:
        return None  # a block's forward events interleave with the next one's
    # the head: from the first event after the last block's forward to the last block's backward
    head_start = max(fwd[n - 1]) + 1
    if head_start >= starts_b[n - 1]:
        return None
    f_begin = [live[starts_f[i]][0] for i in range(n)] + [live[head_start][0]]
    blocks: list[BlockSpan] = []
    for i in range(n):
        f_events = list(range(starts_f[i], starts_f[i + 1] if i + 1 < n else head_start))
        b_end = starts_b[i - 1] if i else _first_outside(events, stack, starts_b[0])
        b_events = list(range(starts_b[i], b_end))
        mlp = lambda e, i=i: _in_mlp(events[e][1], stack, i)  # noqa: E731
        blocks.append(BlockSpan(held=f_begin[i + 1] - f_begin[i],
                                forward=_stretch(f_events, live, f_begin[i], mlp),
                                backward=_stretch(b_events, live, live[starts_b[i]][0], mlp)))
    head_events = list(range(head_start, starts_b[n - 1]))
    held_below = [sum(b.held for b in blocks[: i + 1]) for i in range(n)]
    after = _first_outside(events, stack, starts_b[0])
    return PassBlocks(
        names=[f"{path}.{i}" for i in range(n)],
        blocks=blocks,
        before=f_begin[0],
        head_rise=max(live[e][1] for e in head_events) - f_begin[n],
        backward_base=max(live[starts_b[i]][0] - f_begin[0] - held_below[i] for i in range(n)),
        tail_top=max((live[e][1] for e in range(after, len(events))), default=0),
        head_events=head_events,
    )


def _stretch(events: list[int], live, begin: int, in_mlp) -> Stretch:
    """A stretch's rises above ``begin``; the MLP's is its longest run of consecutive events."""
    top = max(live[e][1] for e in events)
    out = Stretch(rise=top - begin, events=events)
    runs: list[list[int]] = []
    for e in events:
        if in_mlp(e):
            if runs and runs[-1][-1] == e - 1:
                runs[-1].append(e)
            else:
                runs.append([e])
    if runs:
        run = max(runs, key=len)
        inside = set(run)
        out.mlp_events = run
        out.mlp_start = live[run[0]][0] - begin
        out.mlp_rise = max(live[e][1] for e in run) - live[run[0]][0]
        out.other_rise = max([live[e][1] - begin for e in events if e not in inside] + [0])
    return out


def _first_outside(events, stack: LayerStack, start: int) -> int:
    """The first event from ``start`` on that belongs to no block (or the end)."""
    for e in range(start, len(events)):
        if stack.index(events[e][1]) is None:
            return e
    return len(events)


def _in_mlp(module: str, stack: LayerStack, i: int) -> bool:
    prefix = f"{stack.path}.{i}."
    return any(module.startswith(prefix + name + ".") or module == prefix + name for name in MLP_NAMES)


__all__ = ["BlockSpan", "MLP_NAMES", "PassBlocks", "Stretch", "block_figures"]
