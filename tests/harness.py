"""Run a function in N real processes joined by a gloo process group.

The function runs once per rank as ``fn(rank, world_size, *args)``; each rank's return
value comes back to the test (it must pickle). A rank that raises fails the test with
its traceback; a hung collective fails it after ``timeout`` seconds instead of hanging CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from hf_elixir.runtime.host_memory import spawning_cpu_ranks

TESTS_DIR = str(Path(__file__).resolve().parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, queue, args: tuple) -> None:
    try:
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


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
                    launcher_env: bool = True) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``launcher_env``: start the ranks with the environment ``hf-elixir launch`` gives CPU
    ranks (glibc's per-thread cache off); False starts them as plain torchrun would."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args), daemon=True)
             for r in range(world_size)]
    with spawning_cpu_ranks(enabled=launcher_env):
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
