"""Independent pieces of planning work spread over forked copies of this process.

``hf-elixir plan`` spends most of its time in pure-Python work that splits cleanly: the
traces of a folded profile (two models of different depths) and the search (one packing
per chunk size). A forked child inherits everything already imported and built, so it starts
at once and needs nothing pickled but its results. Only the command line asks for workers:
a process that trains (gloo's threads, a DataLoader's) is never forked, since a child of a
threaded process may inherit a lock held by a thread it does not have.
"""

from __future__ import annotations

import os
import pickle
import traceback
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def available_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def forked_map(fn: Callable[[T], R], items: Sequence[T], workers: int = 1) -> list[R]:
    """``[fn(x) for x in items]``, the items dealt round-robin to ``workers`` processes (this
    one and forked children). The results are in the order of ``items`` whatever the
    workers; an exception in a child is raised here. With one worker (or no ``fork``) it is
    the plain loop."""
    workers = min(workers, len(items))
    if workers <= 1 or not hasattr(os, "fork"):
        return [fn(x) for x in items]
    shares = [list(range(w, len(items), workers)) for w in range(workers)]
    children = [_start(fn, items, share) for share in shares[1:]]
    results: list = [None] * len(items)
    try:
        for i in shares[0]:
            results[i] = fn(items[i])
    finally:
        outcomes = [_finish(child) for child in children]
    for (_, _, share), (ok, value) in zip(children, outcomes):
        if not ok:
            raise value
        for i, result in zip(share, value):
            results[i] = result
    return results


def _start(fn: Callable, items: Sequence, share: list[int]) -> tuple[int, int, list[int]]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its share, pickled down the pipe, then out without cleanup
        os.close(read)
        try:
            payload = pickle.dumps((True, [fn(items[i]) for i in share]))
        except BaseException as e:  # noqa: BLE001 - whatever it is, the parent raises it
            try:
                payload = pickle.dumps((False, e))
            except Exception:
                payload = pickle.dumps((False, RuntimeError(traceback.format_exc())))
        with os.fdopen(write, "wb") as pipe:
            pipe.write(payload)
        os._exit(0)
    os.close(write)
    return pid, read, share


def _finish(child: tuple[int, int, list[int]]) -> tuple[bool, object]:
    pid, read, _ = child
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return False, RuntimeError(f"a planning worker (pid {pid}) ended without a result (status {status})")
    return pickle.loads(data)


__all__ = ["available_workers", "forked_map"]
