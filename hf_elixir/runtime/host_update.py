"""The host's optimizer updates, run behind the next forward.

Clipping needs every gradient, so no update may start before the backward is over. Once
``step()`` has done the updates of state the plan keeps on the device, the chunks whose
optimizer state lives on the host are updated on a background thread, one after another in
the order the next forward first needs them (the recorded trace), and each is published as
soon as it is done (its compute-dtype shard written, on a GPU its upload started). ``step()``
returns at once, so the next forward starts while the host still works; each chunk's first
use waits for that chunk only. PyTorch's kernels release the GIL, so the two threads run at
once.

The result is the synchronous update's, bit for bit: the same kernels on the same data in
the same order per chunk, and nothing reads a chunk's shards, master or gradient before its
update is done:

- a fetch of the chunk (``Fetcher``), a gradient arriving for it (``GradReducer``) and the
  runtime's own readers (state dicts, checkpoints, a re-plan, clipping, the next step) wait
  for it (``wait`` / ``wait_all``);
- ``zero_grad`` right after ``step()`` (the usual loop) does not wait: the chunks still
  queued clear their gradient shards on the thread, right after their update
  (``zero_after``);
- the next pass does not prefetch a chunk whose update it has not yet waited for
  (``awaiting``). That set starts the same on every rank (every host chunk is queued, with
  nothing to do on a rank whose shard of it is only padding) and changes only on the main
  thread, at points every rank reaches in the same order, so every rank issues the same
  collectives whatever the thread's timing.

No collective runs on the thread: they would interleave with the main thread's in an order
that differs between ranks.

A fork (a DataLoader's workers, a script that saves in a child) waits for the thread first:
a child is a copy of this thread alone, and would otherwise hold state the thread was
halfway through writing. The wait leaves ``awaiting`` as it is, so a fork on one rank only
changes no rank's collectives.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Callable, Optional, Sequence

from hf_elixir.runtime.threads import using_threads
from hf_elixir.vocab import HfElixirError

#: one chunk's work on the thread: its update and its publication
Job = tuple[int, Callable[[], None], Callable[[], None]]


class HostUpdates:
    """The background updates of one step (at most one step's at a time).

    ``threads``: the intra-op threads the thread's kernels use (the rank's share of the
    cores, runtime/threads.py), or None to leave them as they are. A CPU device passes
    None: its forward computes on the same cores meanwhile, and a thread count set on one
    thread can reach the math libraries' global setting, which the forward's kernels read."""

    def __init__(self, threads: Optional[int]) -> None:
        self.threads = threads
        #: chunks whose update this step put on the thread and the main thread has not yet
        #: waited for (main-thread state: what the next pass may not prefetch)
        self.awaiting: set[int] = set()
        self._done: dict[int, threading.Event] = {}
        self._zero_after: set[int] = set()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        #: when the latest thread finished its last job (``time.perf_counter()``)
        self.finished_at = 0.0
        self._error: Optional[BaseException] = None
        self._zero: Callable[[int], None] = lambda cid: None
        #: seconds the thread spent updating and publishing, and the main thread waiting for
        #: it, since ``take_seconds`` last read them
        self._seconds = dict.fromkeys(("cpu_optimizer", "host_copies", "background", "exposed_cpu",
                                       "exposed_cpu_in_passes"), 0.0)
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)  # a hook cannot be removed: it must not keep this alive
            os.register_at_fork(before=lambda: (lambda live: live and live.finish())(ref()))

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, jobs: Sequence[Job], zero: Callable[[int], None]) -> None:
        """Run ``jobs`` (chunk index, update, publish) on a new thread, in the given order.
        ``zero(cid)`` clears a chunk's gradient shard (for ``zero_after``)."""
        self.wait_all()
        if not jobs:
            return
        self._zero = zero
        self._done = {cid: threading.Event() for cid, _, _ in jobs}
        self.awaiting = set(self._done)
        # not a daemon: the interpreter joins it before it finalizes. A daemon thread still
        # inside a kernel then would be ended mid-call, and the process abort ("terminate
        # called without an active exception") after its work was done
        self._thread = threading.Thread(target=self._run, args=(list(jobs),), name="hf_elixir_host_update",
                                        daemon=False)
        self._thread.start()

    def _run(self, jobs: list[Job]) -> None:
        busy = {"cpu_optimizer": 0.0, "host_copies": 0.0}
        try:
            with using_threads(self.threads) if self.threads else contextlib.nullcontext():
                for cid, update, publish in jobs:
                    t0 = time.perf_counter()
                    update()
                    t1 = time.perf_counter()
                    publish()
                    with self._lock:
                        if cid in self._zero_after:
                            self._zero(cid)
                            self._zero_after.discard(cid)
                        self._done[cid].set()
                    busy["cpu_optimizer"] += t1 - t0
                    busy["host_copies"] += time.perf_counter() - t1
        except BaseException as exc:  # re-raised on the main thread at its next wait
            self._error = exc
        finally:
            self.finished_at = time.perf_counter()
            with self._lock:
                for event in self._done.values():
                    event.set()
                for key, value in busy.items():
                    self._seconds[key] += value
                    self._seconds["background"] += value

    # ------------------------------------------------------------------ main thread
    def wait(self, cid: int) -> None:
        """Block until chunk ``cid``'s update is done (no-op when it is not queued)."""
        if cid not in self.awaiting:
            return
        self.awaiting.discard(cid)
        event = self._done.get(cid)
        if event is not None and not event.is_set():  # a pass waits: its compute is stalled
            t0 = time.perf_counter()
            event.wait()
            waited = time.perf_counter() - t0
            self._seconds["exposed_cpu"] += waited
            self._seconds["exposed_cpu_in_passes"] += waited
        self._raise()

    def wait_all(self) -> None:
        """Block until every queued update is done (before anything reads all of the state)."""
        thread = self._thread
        self.awaiting.clear()
        if thread is None:
            return
        if thread.is_alive():
            t0 = time.perf_counter()
            thread.join()
            self._seconds["exposed_cpu"] += time.perf_counter() - t0
        self._thread = None
        self._raise()

    def finish(self) -> None:
        """Block until the thread's work is done, changing nothing else (before a fork)."""
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join()

    def zero_after(self, cid: int) -> bool:
        """Ask for chunk ``cid``'s gradient shard to be cleared right after its update. False
        when its update is not pending (the caller clears it itself)."""
        with self._lock:
            event = self._done.get(cid)
            if self._thread is None or event is None or event.is_set():
                return False
            self._zero_after.add(cid)
            return True

    def take_seconds(self) -> dict[str, float]:
        """The seconds counted since the last call, and a fresh count."""
        with self._lock:
            out, self._seconds = self._seconds, dict.fromkeys(self._seconds, 0.0)
        return out

    def _raise(self) -> None:
        """Re-raise the thread's error on the main thread. hf_elixir's own errors (a full
        disk's DiskTierError) already say what happened and what to do: they come as they
        are, with the thread's traceback; anything else is wrapped to say where it ran."""
        error, self._error = self._error, None
        if isinstance(error, HfElixirError):
            raise error
        if error is not None:
            raise RuntimeError(f"hf_elixir: a host optimizer update failed on its thread: {error!r}") from error
