"""Run a function in N real processes joined by a gloo process group.

The function runs once per rank as ``fn(rank, world_size, *args)``; each rank's return
value comes back to the test (it must pickle). A rank that raises fails the test with
its traceback; a hung collective fails it after ``timeout`` seconds instead of hanging CI.

Ranks are forked from a server that has imported torch and transformers once (the
``forkserver`` start method): a fresh process per rank and per run, as ``spawn`` gives, but
without each rank paying those imports again (about 3 s of a 2-core machine per run; the
suite starts a few hundred runs). The server is started when the session starts
(``start_rank_server``, from conftest), with the environment CPU ranks are launched with;
each rank then takes the test process's environment as it was at the call, so a test's own
settings reach its ranks as with ``spawn``. Ranks that must start without that environment
(``launcher_env=False``) are spawned.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.forkserver
import os
import pickle
import socket
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

from hf_elixir.runtime.host_memory import spawning_cpu_ranks

TESTS_DIR = str(Path(__file__).resolve().parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what the rank server imports before it forks ranks: the imports every rank would repeat
#: (hf_elixir reads no environment variable when imported, so a rank that sets its own
#: still gets them; the two model families most tests build, about 0.5 s a rank)
RANK_SERVER_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_utils",
                       "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
                       "hf_elixir", "hf_elixir.runtime", "hf_elixir.planner", "rank_server_ready"]


def start_rank_server() -> None:
    """Start the server ranks are forked from, now, with this process's environment as
    ``hf-elixir launch`` gives CPU ranks (glibc reads ``GLIBC_TUNABLES`` when a process
    starts, so the server must start with it for its ranks to have it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_SERVER_PRELOAD)
    with spawning_cpu_ranks(enabled=True):
        mp.forkserver.ensure_running()


class _TestOutput:
    """This process's stdout and stderr at the call (pytest's capture of the running test),
    sent to a forked rank so that it writes there, as a spawned rank, which inherits them,
    does; a forked rank would otherwise write to the server's, outside every test's capture."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _received_fds, (reduction.DupFd(1), reduction.DupFd(2))


def _received_fds(*fds) -> tuple[int, ...]:
    return tuple(fd.detach() for fd in fds)


def _context(launcher_env: bool):
    """Fork ranks from the rank server when they take the launcher's environment."""
    if launcher_env and "forkserver" in mp.get_all_start_methods():
        start_rank_server()  # no-op once running (conftest starts it with the session)
        return mp.get_context("forkserver")
    return mp.get_context("spawn")


def _write_to(output: tuple[int, ...] | None) -> None:
    """Make this forked process write where ``_TestOutput`` said (None: leave it)."""
    if output is not None:
        for received, fd in zip(output, (1, 2)):
            os.dup2(received, fd)
            os.close(received)


def _pool_worker(output: tuple[int, ...]) -> None:
    _write_to(output)
    import torch

    torch.set_num_threads(1)


def process_pool(workers: int = 2) -> ProcessPoolExecutor:
    """Independent one-thread worker processes forked from the rank server, writing to the
    test's output: for tests whose cases need no process group, only separate processes."""
    start_rank_server()
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("forkserver"),
                               initializer=_pool_worker, initargs=(_TestOutput(),))


def _entry(fn: Callable, rank: int, world_size: int, port: int, queue, args: tuple,
           env: dict[str, str], output: tuple[int, ...] | None) -> None:
    try:
        _write_to(output)
        os.environ.clear()  # the test process's environment at the call, as spawn would give
        os.environ.update(env)
        if TESTS_DIR not in sys.path:
            sys.path.insert(0, TESTS_DIR)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, "ok", pickle.dumps(result)))  # plain pickle: no shared-memory handles
    except BaseException:  # report everything, including assertion errors in workers
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if output is not None:
            # a forked rank ends with os._exit, which skips the exit handlers a spawned rank's
            # interpreter runs (what hf_elixir does at a normal exit is tested through them)
            atexit._run_exitfuncs()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
                    launcher_env: bool = True) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``launcher_env``: start the ranks with the environment ``hf-elixir launch`` gives CPU
    ranks (glibc's per-thread cache off); False starts them as plain torchrun would."""
    ctx = _context(launcher_env)
    queue = ctx.Queue()
    port = free_port()
    with spawning_cpu_ranks(enabled=launcher_env):
        env = dict(os.environ)
        output = _TestOutput() if ctx.get_start_method() == "forkserver" else None
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args, env, output), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except Exception:
                raise TimeoutError(
                    f"{world_size}-rank run did not finish within {timeout:.0f}s "
                    f"(finished ranks: {sorted(results)}); a collective probably hung"
                ) from None
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
