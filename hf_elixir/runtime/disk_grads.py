"""Gradient shards of disk-tier chunks: in the chunk's file region, not in host memory.

A chunk on the disk tier would otherwise keep its fp32 gradient shard in host memory from
the backward that fills it to the update that reads it: 4 bytes per element, as much as
its master. For a model whose optimizer state does not fit host memory, those shards alone
may not fit either (a 13B model's are 52 GB), so the gradient gets the last plane of the
chunk's region in the file (ZeRO-Infinity streams gradients to NVMe the same way):

- backward's reduction opens the chunk's gradient (``open``): a buffer of a small ring,
  holding what the plane holds (read from the file if this step has written it, zeros
  otherwise), into which the reduced slice is added; ``close`` writes it back behind, on
  the I/O threads. Only reductions in flight hold buffers, so the ring is
  ``planner.disk.GRAD_RING`` planes (the planner counts them in host memory);
- the update reads the plane with the chunk's other planes (``DiskTier.acquire``);
- ``forget`` is ``zero_grad``: the plane reads as zeros until it is written again; a plane
  counts as written only once its write returned (a failed write, a ``DiskTierError``,
  never leaves a plane that reads as holding data it does not hold);
- a scaling of every gradient shard (fp16's unscale, clipping) cannot rewrite every plane
  without a pass over the disk, so it is recorded (``scale``) and applied, in order, to
  whatever reads the plane next: the update's copy, a norm's copy (``read_scaled``), or the
  next backward's buffer (which then holds the scaled value, as an in-memory shard would).
  The same multiplications on the same values in the same order: bit for bit the host
  tier's gradients;
- clipping's 2-norm of a plane is taken when it is closed, from the buffer in memory
  (``norm``): were it read back for the norm, a step would read every gradient twice.

Versions tell stale copies apart: every ``close`` and ``forget`` makes a new one, and a
buffer (here or in the optimizer's ring) holding an older version is read again.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

import torch

from hf_elixir.planner.disk import GRAD_RING
from hf_elixir.runtime.disk_io import DiskFile, RingBuffer, aligned, settle_all

#: the plane's name in a chunk's region (always its last plane)
GRAD = "grad"
Factor = Union[float, torch.Tensor]


class DiskGrads:
    """The gradient planes of one rank's disk chunks (see the module docstring).

    ``chunks``: the tier's ``DiskChunk`` by index, each with a ``"grad"`` plane last."""

    def __init__(self, file: DiskFile, chunks: dict, ring: int = GRAD_RING) -> None:
        self.file = file
        self.chunks = chunks
        largest = max((c.plane_bytes for c in chunks.values()), default=0)
        self._ring = [RingBuffer(aligned(largest)) for _ in range(ring)] if chunks else []
        self._version = dict.fromkeys(chunks, 0)
        #: chunks whose plane holds a gradient written this run (else it reads as zeros)
        self._stored: set[int] = set()
        #: scalings recorded since each chunk's plane was last written or cleared
        self._scales: dict[int, list[Factor]] = {cid: [] for cid in chunks}
        #: each plane's 2-norm and the version it is of
        self._norms: dict[int, tuple[int, torch.Tensor]] = {}
        #: how many reductions hold each chunk's buffer (backward's thread only)
        self._opens: dict[int, int] = dict.fromkeys(chunks, 0)
        self._clock = 0

    # ------------------------------------------------------------------ bookkeeping
    def offset(self, cid: int) -> int:
        chunk = self.chunks[cid]
        return chunk.offset + chunk.planes.index(GRAD) * chunk.plane_bytes

    def version(self, cid: int) -> int:
        with self.file.lock:
            return self._version[cid]

    def stored(self, cid: int) -> bool:
        with self.file.lock:
            return cid in self._stored

    def _bump(self, cid: int, stored: bool) -> int:
        with self.file.lock:
            self._version[cid] += 1
            (self._stored.add if stored else self._stored.discard)(cid)
            return self._version[cid]

    @property
    def ring_bytes(self) -> int:
        return sum(b.data.numel() * 4 for b in self._ring)

    # ------------------------------------------------------------------ scalings
    def scale(self, factor: Factor) -> None:
        """Every disk chunk's gradient is multiplied by ``factor`` (applied when next read)."""
        with self.file.lock:
            for scales in self._scales.values():
                scales.append(factor)

    def apply_scales(self, cid: int, grad: torch.Tensor, consume: bool = False) -> torch.Tensor:
        """``grad`` (a copy of chunk ``cid``'s plane as stored) multiplied by the scalings
        recorded since; ``consume``: ``grad`` becomes the plane's value (it is written back),
        so the record is cleared."""
        with self.file.lock:
            scales = list(self._scales[cid])
            if consume:
                self._scales[cid].clear()
        for factor in scales:
            grad.mul_(factor)
        return grad

    def norm(self, cid: int) -> Optional[torch.Tensor]:
        """Chunk ``cid``'s gradient's 2-norm (``torch.linalg.vector_norm``) if it is known
        without reading the plane: taken at its last ``close`` (zero after ``forget``), and
        no scaling recorded since. None otherwise."""
        with self.file.lock:
            version, value = self._norms.get(cid, (-1, None))
            fresh = version == self._version[cid] and not self._scales[cid]
        return value if fresh else None

    def load(self, cid: int, view: torch.Tensor) -> None:
        """Fill ``view`` (a whole plane) with chunk ``cid``'s gradient as stored: read from
        the file if this run wrote it, else zeros (never what the file held before)."""
        if self.stored(cid):
            self.file.read(view, self.offset(cid))
        else:
            view.zero_()

    def read_scaled(self, cid: int) -> torch.Tensor:
        """A fresh copy of chunk ``cid``'s gradient as an in-memory shard would hold it now
        (for a norm or an inf check); reads the plane, changes nothing."""
        self.file.check()
        chunk = self.chunks[cid]
        out = aligned(chunk.plane_bytes)
        self.load(cid, out)
        return self.apply_scales(cid, out[: chunk.numel])

    # ------------------------------------------------------------------ backward's buffers
    def _buffer(self, cid: int) -> RingBuffer:
        buf = next((b for b in self._ring if b.cid == cid), None)
        if buf is None:
            idle = sorted((b for b in self._ring if not b.held), key=lambda b: (b.cid is not None, b.used))
            if not idle:
                raise RuntimeError("hf_elixir disk tier: every gradient buffer is held "
                                   f"({len(self._ring)} reductions in flight)")
            buf = idle[0]
            buf.cid, buf.version = cid, -1
        buf.settle()  # its last write-back has reached the file before the buffer changes
        return buf

    def open(self, cid: int) -> torch.Tensor:
        """Chunk ``cid``'s gradient shard in a ring buffer, to add into until ``close``.
        A chunk may be opened again before it is closed (reduced twice in one backward: late
        on another rank, its first reduction still in flight): both add into the one
        buffer, written back at the last ``close``."""
        self.file.check()  # a transfer failed: the planes are no longer whole
        chunk = self.chunks[cid]
        held = next((b for b in self._ring if b.cid == cid and b.held), None)
        if held is not None:
            self._opens[cid] += 1
            return held.data[: chunk.numel]
        buf = self._buffer(cid)
        version = self.version(cid)
        if buf.version != version:  # not what the plane holds now: read it (or zeros)
            self.load(cid, buf.data[: chunk.plane_bytes // 4])
            buf.version = version
        self._clock += 1
        buf.held, buf.used = True, self._clock
        self._opens[cid] = 1
        return self.apply_scales(cid, buf.data[: chunk.numel], consume=True)

    def close(self, cid: int) -> None:
        """Done adding into chunk ``cid``'s gradient: written back behind."""
        buf = next((b for b in self._ring if b.cid == cid and b.held), None)
        if buf is None:
            raise RuntimeError(f"hf_elixir disk tier: gradient of chunk {cid} closed without being opened")
        self._opens[cid] -= 1
        if self._opens[cid]:  # another reduction still adds into it
            return
        buf.held = False
        norm = torch.linalg.vector_norm(buf.data[: self.chunks[cid].numel], 2.0)
        # a new version now (older copies are stale); stored once the write has returned
        buf.version = self._bump(cid, stored=False)
        with self.file.lock:
            self._norms[cid] = (buf.version, norm)
        view = buf.data[: self.chunks[cid].plane_bytes // 4]
        buf.future, buf.writing = self.file.submit(self._write, view, cid, buf.version), True

    def _write(self, view: torch.Tensor, cid: int, version: int) -> None:
        """Write a plane back (on an I/O thread); it holds the gradient once that returned,
        unless the gradient changed meanwhile (``forget``: it reads as zeros)."""
        self.file.write(view, self.offset(cid))
        with self.file.lock:
            if self._version[cid] == version:
                self._stored.add(cid)

    @contextlib.contextmanager
    def opened(self, cid: int) -> Iterator[torch.Tensor]:
        grad = self.open(cid)
        try:
            yield grad
        finally:
            self.close(cid)

    def forget(self, cid: int) -> None:
        """Chunk ``cid``'s gradient is zero (``zero_grad``): nothing is read or written."""
        with self.file.lock:
            self._scales[cid].clear()
        version = self._bump(cid, stored=False)
        with self.file.lock:
            self._norms[cid] = (version, torch.zeros((), dtype=torch.float32))

    def settle(self) -> None:
        """Wait until every gradient written back has reached the file (before anything
        reads the planes from another thread or buffer)."""
        settle_all(self._ring)

    @property
    def buffers(self) -> list[RingBuffer]:
        """The gradient ring (its I/O is waited for with the tier's: ``DiskTier.close``)."""
        return self._ring
