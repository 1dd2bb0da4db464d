"""Packing: how a model's parameters fill chunks, where each chunk's state is placed, and the
sizes chunks then take. Shared by the search (which prices packings), the plan record and the
runtime (which lays chunks out exactly as priced)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

from hf_elixir.planner.record import chunk_layout


def pack(order: Sequence[str], sizes: dict[str, int], chunk_size: int,
         frozen: Collection[str] = frozenset()) -> list[list[str]]:
    """Pack parameters, in first-use order, greedily into chunks of ``chunk_size`` elements.

    Keeping the order means the forward needs chunks one after another, so each is gathered
    once per pass; a parameter that does not fit the current chunk opens the next one.

    Parameters in ``frozen`` (``requires_grad=False``) are packed apart from the trainable
    ones, each kind greedily in its own first-use order, so that no chunk mixes them (a
    mixed chunk would need gradient memory for its frozen part). Cutting one sequence at
    every change of kind instead would give LoRA a chunk per adapter. The chunks of both
    kinds are then listed by the first use of their first parameter, so the list is still
    in fetch order. Without frozen parameters this is the plain greedy packing.
    """
    position = {name: i for i, name in enumerate(order)}
    chunks: list[list[str]] = []
    for kind in (False, True):
        chunks += _greedy([n for n in order if (n in frozen) == kind], sizes, chunk_size)
    chunks.sort(key=lambda c: position[c[0]])
    return chunks


def _greedy(order: Sequence[str], sizes: dict[str, int], chunk_size: int) -> list[list[str]]:
    chunks: list[list[str]] = []
    used = chunk_size
    for name in order:
        n = sizes[name]
        if n > chunk_size:
            raise ValueError(f"parameter {name!r} ({n} elements) exceeds chunk_size {chunk_size}")
        if used + n > chunk_size:
            chunks.append([])
            used = 0
        chunks[-1].append(name)
        used += n
    return chunks


@dataclass(frozen=True)
class Placements:
    """Which chunks are frozen and which chunks' state lives in host memory.

    ``optim_cpu``: trainable chunks whose fp32 master, optimizer state and gradient shard
    are on the CPU. ``param_cpu``: chunks, trainable or frozen, whose compute-dtype shard is
    on the CPU. A frozen chunk has no optimizer side, so offloading it is only ever its
    shard: read-only, uploaded for each gather and never written back.
    """

    frozen: frozenset[int] = frozenset()
    optim_cpu: frozenset[int] = frozenset()
    param_cpu: frozenset[int] = frozenset()

    @classmethod
    def tails(cls, n_chunks: int, frozen: Collection[int], optim_cpu: int, param_cpu: int,
              frozen_cpu: int) -> "Placements":
        """Offload by counts: the last ``optim_cpu`` trainable chunks' optimizers, the last
        ``param_cpu`` trainable chunks' shards (within those) and the last ``frozen_cpu``
        frozen chunks' shards. The tail goes first: its gradients are reduced first in
        backward, so their copies overlap the rest of backward."""
        fz = sorted(frozen)
        tr = [i for i in range(n_chunks) if i not in frozen]
        return cls(frozenset(fz), frozenset(tr[len(tr) - optim_cpu:]),
                   frozenset(tr[len(tr) - param_cpu:]) | frozenset(fz[len(fz) - frozen_cpu:]))

    def trainable(self, n_chunks: int) -> list[int]:
        return [i for i in range(n_chunks) if i not in self.frozen]


def layout_sizes(chunks: Sequence[Sequence[str]], sizes: dict[str, int], world_size: int,
                 elem_bytes: int) -> list[int]:
    """Elements of each chunk as the runtime allocates it (``plan.chunk_layout``): its
    contents with aligned offsets, not ``chunk_size``."""
    return [chunk_layout([sizes[n] for n in names], elem_bytes, world_size)[0] for names in chunks]


def adopts_gradient(numels: Sequence[int], chunk_elems: int) -> bool:
    """Whether a chunk takes autograd's gradient tensor as its gradient buffer instead of
    copying it (``GradReducer``): it holds one parameter that fills it as laid out, without
    padding. The runtime and the cost model both ask this."""
    return len(numels) == 1 and numels[0] == chunk_elems


def adopting_chunks(chunks: Sequence[Sequence[str]], sizes: dict[str, int], elems: Sequence[int]) -> frozenset[int]:
    """The chunks that adopt autograd's gradient (``adopts_gradient``)."""
    return frozenset(i for i, names in enumerate(chunks) if adopts_gradient([sizes[n] for n in names], elems[i]))


def chunk_size_candidates(sizes: Iterable[int], world_size: int, limit: int = 8) -> list[int]:
    """Chunk sizes worth trying: from the largest parameter up to a few times it.

    Every size is a multiple of the world size (and of 64 elements when the model is large
    enough, for aligned shards). The ones with the least padding are kept.
    """
    sizes = list(sizes)
    largest, total = max(sizes), sum(sizes)
    align = world_size * (64 if largest >= 64 * 1024 else 1)

    def up(x: float) -> int:
        return int(math.ceil(x / align) * align)

    raw = {up(largest * f) for f in (1.0, 1.125, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)}
    raw.add(up(total))  # everything in one chunk (small models)
    for k in (2, 3, 4, 6, 8, 12, 16, 24, 32):  # an even split into k chunks
        if total / k >= largest:
            raw.add(up(total / k * 1.02))
    cands = sorted(s for s in raw if largest <= s <= max(up(total), up(largest)))

    def waste(s: int) -> float:
        used, n = s, 0
        for x in sizes:  # padding of a sequential greedy packing (order-independent estimate)
            if used + x > s:
                n += 1
                used = 0
            used += x
        return (n * s - total) / total

    scored = sorted(cands, key=lambda s: (round(waste(s), 3), s))
    keep = sorted(set(scored[:limit]) | {cands[0]})
    return keep
