"""The disk tier's file: aligned host buffers, counted reads and writes, and the I/O threads.

One file per rank holds every disk chunk's planes (``disk_tier.py`` lays them out). Two
consumers move planes through it: the optimizer side (``DiskTier``: master and state, read
before a chunk's update and written behind it) and the gradient side (``DiskGrads``: a
chunk's fp32 gradient shard, written as backward reduces it and read by its update). Both
hand their transfers to the same I/O threads, which call ``os.preadv``/``os.pwritev`` (they
release the GIL) in submission order, and count bytes and seconds in one place.

A transfer that fails (``ENOSPC``, ``EIO``, a short transfer) becomes a ``DiskTierError``
saying what failed and what to do. It is recorded as the file's ``failure``: the file no
longer holds a whole state, so every later use of the tier raises it again instead of
reading planes that were never written. On the I/O thread it is raised where the consumer
next waits for that transfer (``RingBuffer.settle``); the consumers mark a plane as holding
data only after its write returned.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from hf_elixir.vocab import HfElixirError

#: O_DIRECT's alignment of buffers, offsets and sizes (a page covers every device's block)
ALIGN = 4096


class DiskTierError(HfElixirError, ValueError):
    """The disk tier cannot be used as asked: no path, a bad path, too little space, a
    directory in use by another run, a tier that was closed, or a transfer that failed."""


#: what a failed transfer's errno means for the user
_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "this user's disk quota is used up",
    errno.EIO: "the disk reported an I/O error",
    errno.EINVAL: "the file system refused the transfer (O_DIRECT alignment)",
}


def pad(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned(nbytes: int) -> torch.Tensor:
    """An fp32 host buffer of ``nbytes`` whose first byte is ``ALIGN``-aligned (O_DIRECT)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + nbytes].view(torch.float32)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (contiguous) as ``os.preadv``/``os.pwritev`` take them, no copy."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class IOThreads:
    """Daemon threads that run the reads and writes handed to them, in order of submission.

    Not ``ThreadPoolExecutor``: at interpreter exit it stops taking work before the host
    update thread (which submits write-backs) is joined. Daemon threads never hold up an
    exit, and the tier's own exit handler waits for every transfer before the files go."""

    def __init__(self, count: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name="hf_elixir_disk_io", daemon=True)
                         for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # re-raised where the consumer waits for it
                future.set_exception(exc)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


@dataclass
class Counters:
    """Bytes moved between host buffers and the file since it opened, and the seconds spent
    moving them: per direction, summed over the I/O threads' calls, and ``busy_seconds``, the
    wall time while any transfer was in flight (reads and writes overlap, so it is less than
    their sum). Bytes over ``busy_seconds`` is the bandwidth the tier got from the disk,
    comparable with ``measure/disk.py``'s figures (``benchmarks/bench_disk_tier.py``)."""

    read_bytes: int = 0
    written_bytes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    busy_seconds: float = 0.0
    active: int = 0               #: transfers in flight now
    busy_since: float = 0.0       #: when the first of them started


@dataclass(eq=False)
class RingBuffer:
    """One host buffer of a ring: a chunk's planes (or one of them), aligned, and the I/O in
    flight on it."""

    data: torch.Tensor                 #: fp32, ALIGN-aligned
    cid: Optional[int] = None          #: whose planes it holds (or is reading, writing)
    future: Optional[Future] = None    #: the read or write in flight
    writing: bool = False              #: ``future`` writes the buffer back
    held: bool = False                 #: handed out and not yet released
    used: int = 0                      #: when last handed out (least recently used goes first)
    version: int = -1                  #: DiskGrads: the gradient version the data holds

    def settle(self) -> None:
        """Wait for the I/O in flight on the buffer; re-raise its error here."""
        future, self.future, self.writing = self.future, None, False
        if future is not None:
            future.result()

    @property
    def busy(self) -> bool:
        return self.future is not None and not self.future.done()


def settle_all(buffers: Iterable[RingBuffer]) -> None:
    """Wait for the I/O in flight on every buffer, then raise the first error: one failed
    transfer must not leave others running on a file that is about to be closed."""
    first: Optional[BaseException] = None
    for buf in buffers:
        try:
            buf.settle()
        except BaseException as exc:  # re-raised once every transfer is over
            first = first or exc
    if first is not None:
        raise first


class DiskFile:
    """The rank's state file: an open descriptor, the I/O threads and the byte counters."""

    def __init__(self, fd: int, path: Path, direct: bool, threads: int = 2) -> None:
        self.fd = fd
        self.path = path
        #: opened with O_DIRECT (the page cache is bypassed)
        self.direct = direct
        self.io = IOThreads(threads)
        self.counters = Counters()
        #: guards the counters and the consumers' shared bookkeeping (which planes hold data)
        self.lock = threading.Lock()
        #: the first transfer that failed: the file no longer holds a whole state
        self.failure: Optional[DiskTierError] = None

    def submit(self, fn: Callable, *args) -> Future:
        return self.io.submit(fn, *args)

    def read(self, view: torch.Tensor, offset: int) -> None:
        self._transfer(os.preadv, view, offset)

    def write(self, view: torch.Tensor, offset: int) -> None:
        self._transfer(os.pwritev, view, offset)

    def check(self) -> None:
        """Raise the recorded failure, if a transfer failed: nothing the file holds is used
        after that (a plane whose write failed holds neither its old nor its new value)."""
        failure = self.failure
        if failure is not None:
            raise DiskTierError(str(failure)) from failure

    def _failed(self, exc: OSError, reading: bool, offset: int, nbytes: int) -> DiskTierError:
        """``exc`` as the ``DiskTierError`` the user sees; the first one is recorded."""
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        reason = _REASONS.get(exc.errno or 0, exc.strerror or str(exc))
        error = DiskTierError(
            f"the disk tier could not {'read' if reading else 'write'} {nbytes} bytes at byte {offset} of "
            f"{self.path}: {reason} ({code}: {exc.strerror or exc}). The optimizer state in this file is no "
            "longer whole, so this run cannot go on: free space on that disk or fix it (or name another "
            "nvme_path), then resume from the last checkpoint")
        with self.lock:
            if self.failure is None:
                self.failure = error
        return error

    def counted(self) -> dict[str, float]:
        """A copy of the counters, read between two steps or during one."""
        with self.lock:
            return {k: v for k, v in vars(self.counters).items() if k not in ("active", "busy_since")}

    def _transfer(self, call, view: torch.Tensor, offset: int) -> None:
        data = byte_view(view)
        done, counters = 0, self.counters
        with self.lock:
            start = time.perf_counter()
            counters.busy_since = start if counters.active == 0 else counters.busy_since
            counters.active += 1
        try:
            while done < len(data):
                moved = call(self.fd, [data[done:]], offset + done)
                if moved <= 0:
                    raise OSError(errno.EIO, f"short {'read' if call is os.preadv else 'write'}")
                done += moved
        except OSError as exc:
            raise self._failed(exc, call is os.preadv, offset + done, len(data) - done) from exc
        finally:
            with self.lock:
                end = time.perf_counter()
                counters.active -= 1
                if counters.active == 0:
                    counters.busy_seconds += end - counters.busy_since
                if call is os.preadv:
                    counters.read_bytes += done
                    counters.read_seconds += end - start
                else:
                    counters.written_bytes += done
                    counters.write_seconds += end - start
