"""How a training process ends: its gloo worker threads must not outlive the interpreter.

A gloo process group runs its collectives on worker threads (``pt_gloo_runloop``). When a
worker finishes a collective it drops its reference to the work's tensors; if that is the
last reference to a tensor that has a Python object, the worker takes the GIL to free it.
During the interpreter's own teardown any thread that asks for the GIL is ended with
``pthread_exit``, whose forced unwinding through torch's C++ frames calls
``std::terminate``: the process aborts ("terminate called without an active exception",
SIGABRT) after it has done all its work. The backtrace of such an abort is
``ProcessGroupGloo::runLoop -> TensorImpl::decref_pyobject -> PyEval_AcquireThread ->
pthread_exit -> __gxx_personality_v0 -> std::terminate``.

Destroying the process groups at exit, while the interpreter is whole, joins those threads,
but only when nothing else holds the group: ``destroy_process_group()`` removes torch's
references, and a DDP reducer (or any C++ owner) keeps the group and its threads alive, in
which case they run on into the teardown. So a normal end has two steps:

1. ``destroy_process_groups_at_exit``: collect the garbage (a script's finished Trainer and
   model are unreachable cycles that still hold the groups) and destroy the groups.
2. ``run_script`` (the launcher's bootstrap, the tests' plain reference runs) knows how the
   script ended; if gloo worker threads are still alive after step 1, the process ends
   there with the script's own exit status (``os._exit``, after flushing its output), so
   no thread can reach the interpreter's teardown. Everything the script wrote is already
   written; only the teardown of objects still alive is skipped.

Neither step runs after an uncaught exception: a failing rank exits at once, so its launcher
can stop the others. This module imports nothing from hf_elixir, so the tests' plain
reference runs load it by path and get the same exit without importing the package.
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import sys
from dataclasses import dataclass
from typing import Optional

#: the name torch gives a gloo process group's worker threads
GLOO_WORKER_THREAD = "pt_gloo_runloop"
#: set to 1 to have the final exit step say which way the process ended (tests read it)
REPORT_ENV = "HF_ELIXIR_EXIT_REPORT"


@dataclass
class ExitWatch:
    """What this process knows about its own end."""

    status: Optional[int] = None  # the script's exit status, once run_script has seen it end
    uncaught: bool = False  # an exception reached sys.excepthook
    hooked: bool = False  # sys.excepthook notes uncaught exceptions
    destroy_registered: bool = False
    final_registered: bool = False


WATCH = ExitWatch()


def _note_uncaught_exceptions() -> None:
    if WATCH.hooked:
        return
    WATCH.hooked = True
    previous = sys.excepthook

    def note(kind, value, tb):
        WATCH.uncaught = True
        previous(kind, value, tb)

    sys.excepthook = note


def gloo_worker_threads() -> int:
    """How many gloo worker threads this process has now (Linux thread names; 0 where the
    platform does not name threads in ``/proc``)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended while we looked
            pass
    return count


def destroy_process_groups_at_exit() -> None:
    """Step 1: at a normal exit, collect the garbage and destroy the process groups.

    Registered by ``ElixirAccelerator``; the runtime's own exit handlers (waiting for the
    gathers the last optimizer step prefetched) are registered later and so run first."""
    _note_uncaught_exceptions()
    if not WATCH.destroy_registered:
        WATCH.destroy_registered = True
        atexit.register(destroy_process_groups)


def destroy_process_groups() -> None:
    """Destroy every process group unless the process is failing; say so if it cannot."""
    if WATCH.uncaught or "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    try:
        dist.destroy_process_group()
    except Exception as e:  # exit goes on; say why the groups were left to the interpreter
        print(f"hf_elixir: could not destroy the process groups at exit: {e}", file=sys.stderr, flush=True)


def _end_before_teardown() -> None:
    """Step 2, the last exit handler: destroy what is left, and end the process here if gloo
    worker threads outlived their groups."""
    if WATCH.uncaught or WATCH.status is None:
        return
    destroy_process_groups()
    alive = gloo_worker_threads()
    report = os.environ.get(REPORT_ENV) == "1"
    if not alive:
        if report:
            print(f"hf_elixir exit: no gloo worker threads left; status {WATCH.status}", file=sys.stderr, flush=True)
        return
    if report:
        print(f"hf_elixir exit: {alive} gloo worker threads outlived their process groups; ending with "
              f"status {WATCH.status} before the interpreter's teardown", file=sys.stderr, flush=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by the script
            pass
    os._exit(WATCH.status)


def freeze_for_teardown() -> None:
    """For a process whose work is done and written (a benchmark job, the tests' plain
    reference runs): collect the garbage there is, then freeze every surviving object out of
    the cycle collections of the interpreter's teardown, which walk all of torch's and
    transformers' objects (about a second of such a process's exit; 0.2 s left). Not done in
    hf_elixir's workers: a user's object may still have a finalizer's work to do there (an
    unclosed zip file in a reference cycle), and only those collections would run it."""
    gc.collect()
    gc.freeze()


def _status(code: object) -> int:
    """The status the interpreter gives ``SystemExit(code)``: None is 0, a message is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def run_script(path: str, args: list[str]) -> None:
    """Run ``path`` as ``__main__`` with ``args``, as ``python path args`` would, and end the
    process safely afterwards (step 2). The final handler is registered before the script
    runs, so it runs after every handler the script and its libraries register."""
    _note_uncaught_exceptions()
    if not WATCH.final_registered:
        WATCH.final_registered = True
        atexit.register(_end_before_teardown)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        WATCH.status = _status(e.code)
        raise
    WATCH.status = 0
