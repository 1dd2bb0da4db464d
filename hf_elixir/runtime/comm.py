"""Collectives over a process group, with a single-process fallback.

Two process groups carry the traffic, both made at wrap time over the caller's ranks: one
for parameter all-gathers and one for gradient reduce-scatters and the small all-reduces of
the optimizer step. Gathers are issued in the (rank-identical) fetch order and
reduce-scatters in the (rank-identical) descending chunk order, but how the two sequences
interleave depends on when each rank's autograd engine reaches a hook; separate groups make
each sequence match on its own. Neither is the caller's group, so the caller's collectives
(a barrier, a metric gather) never queue behind the gathers the optimizer step leaves
running for the next pass (a barrier queued behind them would wait for gathers it does not
need, and a plan that starts more of them would pay for it).

The backend follows the compute device, not the group's backend name: CUDA tensors go over
NCCL and host tensors over gloo, whatever the caller's group runs (``device="cpu"`` on a
GPU machine whose default group is NCCL gets gloo groups). Callers move host tensors
(offloaded shards) to the device before a collective, so a host shard and a device shard
never meet in one call.

Every collective is counted in ``Collectives.counter`` (bytes received per rank, by kind;
the convention is in ``hf_elixir.planner.traffic``), so ``ElixirModule.comm_report()`` can say
what a step moved and the planner's prediction can be checked against it.

The tensor collectives changed names in torch 2.13 (``all_gather_single``,
``reduce_scatter_single``); older releases only have ``all_gather_into_tensor`` and
``reduce_scatter_tensor``. Both are looked up when the groups are made, so every torch the
package accepts runs the same code.
"""

from __future__ import annotations

import atexit
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from hf_elixir.planner.traffic import COLLECTIVES_ENV, CommCounter, host_collectives
from hf_elixir.runtime.schedule import Schedule
from hf_elixir.runtime.widen import add_widened


class _WaitAll:
    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


class Work:
    """A handle for a collective that may still be running, with an optional finishing
    step to run once it is done (None: already done)."""

    def __init__(self, handle: Optional[object] = None, then: Optional[Callable[[], object]] = None) -> None:
        self._handle = handle
        self._then = then
        self.schedule: Optional[Schedule] = None  # set when the schedule tracks this collective
        self.serial = -1
        if handle is None and then is not None:  # synchronous: finish now
            self.wait()

    @property
    def done(self) -> bool:
        """Waited for (a handle still held may have finished in the backend, unobserved)."""
        return self._handle is None and self._then is None

    def wait(self) -> None:
        if self._handle is not None:
            if self.schedule is not None:
                self.schedule.waited(self.serial)
            self._handle.wait()
            self._handle = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _accumulate(target: torch.Tensor, source: torch.Tensor, scale: float, counter: CommCounter) -> None:
    if source.device != target.device:
        # host-to-device may run async on the stream; device-to-host must be complete
        # before the CPU reads it
        counter.add("device_to_host" if target.device.type == "cpu" else "host_to_device",
                    source.numel() * source.element_size())
        source = source.to(target.device, non_blocking=target.device.type != "cpu")
    add_widened(target, source, alpha=scale)


__all__ = ["COLLECTIVES_ENV", "Collectives", "CommCounter", "Work"]


def collective_function(new: str, old: str) -> Callable:
    """``torch.distributed.<new>`` where this torch has it, else ``<old>`` (same signature)."""
    fn = getattr(dist, new, None)
    if fn is None:
        fn = getattr(dist, old, None)
    if fn is None:
        raise RuntimeError(
            f"torch {torch.__version__} has neither torch.distributed.{new} nor {old}; "
            "install a torch between 2.4 and 2.14"
        )
    return fn


def backend_for(device: torch.device) -> str:
    """The backend that carries tensors of ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class Collectives:
    """The process groups the runtime talks over; world size 1 needs no group at all.

    gloo's collectives are not the ring algorithms NCCL runs, and the ones that should move
    fewer bytes are not the faster ones (timings in docs/gpu.md, "Devices and collectives"):

    So on gloo (``gloo=True``) a gather is W broadcasts and a gradient reduction stays an
    all-reduce of the full buffer: no reduce-scatter variant was as fast, although each
    moves half the all-reduce's bytes (the counter records the all-reduce honestly, as
    ``all_reduce``). NCCL uses the native all-gather and reduce-scatter.
    """

    rank: int
    world_size: int
    gather_group: Optional[dist.ProcessGroup] = None
    reduce_group: Optional[dist.ProcessGroup] = None
    gloo: bool = False  # host tensors: broadcasts and all-reduces (see above)
    global_ranks: tuple[int, ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _gather_fn: Callable = field(default=None, repr=False)
    _reduce_scatter_fn: Callable = field(default=None, repr=False)
    counter: CommCounter = field(default_factory=CommCounter, repr=False)
    #: groups ``create`` made that ``close`` can destroy safely (those over the whole world);
    #: the caller's own group is never among them
    owned_groups: tuple[dist.ProcessGroup, ...] = field(default=(), repr=False)
    closed: bool = field(default=False, repr=False)
    #: asynchronous collectives issued and perhaps not waited for (see ``drain``)
    in_flight: list = field(default_factory=list, repr=False)
    #: the collectives of each training pass, for a hollow finish after a failure (schedule.py)
    schedule: Schedule = field(default_factory=Schedule, repr=False)
    #: whether collectives are recorded into ``schedule`` (off when nothing recovers: a
    #: runtime without out-of-memory recovery pays nothing for it)
    recording: bool = field(default=True, repr=False)

    @classmethod
    def create(cls, process_group: Optional[dist.ProcessGroup] = None,
               device: Optional[torch.device] = None) -> "Collectives":
        """Groups for ``device``'s tensors over the ranks of ``process_group`` (default: the
        default group if one exists). Collective when distributed: call on every rank."""
        device = torch.device("cpu") if device is None else torch.device(device)
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        if process_group is None:
            return cls(rank=0, world_size=1, device=device)
        world_size = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        if world_size == 1:
            return cls(rank=rank, world_size=1, gather_group=process_group, reduce_group=process_group,
                       device=device)
        ranks = dist.get_process_group_ranks(process_group)
        backend = backend_for(device)
        # over the whole world every rank makes the groups, and they get counted names that
        # are never reused, so close() may destroy them; a subgroup's ranks make theirs alone
        # (local synchronisation), named by a hash of the ranks and the number of live groups,
        # which a destroyed group would hand to the next one, stale rendezvous keys and all
        whole_world = world_size == dist.get_world_size()
        make = lambda: dist.new_group(ranks, backend=backend, use_local_synchronization=not whole_world)  # noqa: E731
        # both groups are the runtime's own (module docstring): gloo's barrier waits for
        # every earlier collective of its group, and NCCL runs one communicator's in order
        gather_group = make()
        reduce_group = make()
        owned = [gather_group, reduce_group] if whole_world else []
        host = backend == "gloo" and host_collectives(device.type)
        comm = cls(rank=rank, world_size=world_size, gather_group=gather_group,
                   reduce_group=reduce_group, gloo=host, global_ranks=tuple(ranks), device=device,
                   owned_groups=tuple(owned),
                   _gather_fn=collective_function("all_gather_single", "all_gather_into_tensor"),
                   _reduce_scatter_fn=collective_function("reduce_scatter_single", "reduce_scatter_tensor"))
        # A process that exits while one of its collectives still runs in the backend's
        # thread aborts ("terminate called without an active exception"). The optimizer
        # step leaves the next pass's gathers running, and the ElixirModule that issued them
        # may be gone by exit: the groups' owner waits for them, whatever became of it.
        atexit.register(comm.release_at_exit)
        return comm

    def drain(self) -> None:
        """Wait for every asynchronous collective issued here that nobody waited for."""
        works, self.in_flight = self.in_flight, []
        for work in works:
            work.wait()

    def release_at_exit(self) -> None:
        """At interpreter exit: wait for what is still in flight, then let go of the groups
        (this object stays referenced by the exit handler list until the very end), so that
        destroying the process groups, the integration's last exit handler, frees them at
        once, while the interpreter is still whole, rather than during its teardown."""
        self.drain()
        self.closed = True
        self.gather_group = self.reduce_group = None
        self.owned_groups = ()

    def _record(self, call: tuple, work: Optional[Work] = None) -> None:
        if self.recording:
            self.schedule.issued(call, work)

    @contextlib.contextmanager
    def not_recording(self) -> Iterator[None]:
        """Collectives made inside are not part of any schedule (a hollow finish)."""
        before, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = before

    def _track(self, work: Work) -> Work:
        """Remember an asynchronous collective until it is waited for (``drain``)."""
        self.in_flight = [w for w in self.in_flight if not w.done]
        self.in_flight.append(work)
        return work

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def close(self) -> None:
        """Destroy the groups ``create`` made. Collective: every rank calls it, after its
        last collective here has finished.

        Each gloo group holds its own threads and sockets (3 threads and 5 descriptors per
        group on torch 2.13), so a process that builds many runtimes (a sweep, a notebook, a
        test run) grows by that much per runtime until it closes them. The barrier comes
        first: without it, destroying hung in a two-rank probe after two or three groups.
        Groups over a subset of the world stay (see ``create``)."""
        if self.closed:
            return
        self.drain()
        self.closed = True
        for group in self.owned_groups:
            dist.barrier(group=group)
            dist.destroy_process_group(group)
        # the group's threads end only when the last Python reference to it goes
        if self.gather_group in self.owned_groups:
            self.gather_group = None
        if self.reduce_group in self.owned_groups:
            self.reduce_group = None
        self.owned_groups = ()

    def _check_usable(self, *tensors: torch.Tensor) -> None:
        """The groups carry ``self.device``'s tensors only; anything else is a runtime bug
        that NCCL would report as a hang or an illegal memory access. Closed groups carry
        nothing."""
        if self.closed:
            raise RuntimeError("this runtime was closed (ElixirModule.close(), or the interpreter is "
                               "exiting); its process groups are gone. Wrap the model in a new "
                               "ElixirModule to train it again")
        for t in tensors:
            if t.device.type != self.device.type:
                raise RuntimeError(
                    f"hf_elixir internal error: a {t.device} tensor reached a collective made for "
                    f"{self.device}; host shards must be copied to the device first"
                )

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Work:
        """Fill ``output`` (world_size * shard elements) with every rank's shard, in rank order."""
        if not self.distributed:
            output.copy_(shard)
            return Work()
        self._check_usable(output, shard)
        self.counter.collective("all_gather", output.numel() * output.element_size(), self.world_size)
        if self.gloo:  # gloo: one broadcast from each rank of its own shard
            n = shard.numel()
            output[self.rank * n : (self.rank + 1) * n].copy_(shard)
            handles = [  # every rank joins every broadcast, in the same order
                dist.broadcast(output[r * n : (r + 1) * n], src=self.global_ranks[r],
                               group=self.gather_group, async_op=True)
                for r in range(self.world_size)
            ]
            work = Work(_WaitAll(handles))
            self._record(("all_gather", n, shard.dtype, async_op), work if async_op else None)
            if not async_op:
                work.wait()
                return work
            return self._track(work)
        work = Work(self._gather_fn(output, shard, group=self.gather_group, async_op=async_op))
        self._record(("all_gather", shard.numel(), shard.dtype, async_op), work if async_op else None)
        return self._track(work) if async_op else work

    @property
    def reduce_needs_scratch(self) -> bool:
        """Whether reduce_scatter_accumulate needs a shard-sized scratch tensor."""
        return self.distributed and not self.gloo

    def reduce_scatter_accumulate(
        self, target: torch.Tensor, full: torch.Tensor, scratch: Optional[torch.Tensor] = None,
        async_op: bool = False,
    ) -> Work:
        """Add this rank's slice of the mean of ``full`` over ranks into ``target``.

        ``full`` may be overwritten (the all-reduce path reduces it in place); ``scratch``
        (shard-sized, ``full``'s dtype) is needed when reduce_needs_scratch."""
        n = target.numel()
        if not self.distributed:
            return Work(None, then=lambda: _accumulate(target, full[:n], 1.0, self.counter))
        self._check_usable(full)
        if self.gloo:
            piece = full[self.rank * n : (self.rank + 1) * n]
            self.counter.collective("all_reduce", full.numel() * full.element_size(), self.world_size)
            handle = dist.all_reduce(full, group=self.reduce_group, async_op=async_op)
            work = Work(handle, then=lambda: _accumulate(target, piece, 1.0 / self.world_size, self.counter))
            self._record(("reduce_scatter_accumulate", n, full.numel(), full.dtype, async_op),
                         work if async_op else None)
            return work
        with self.not_recording():
            work = self.reduce_scatter_mean(scratch, full, async_op,
                                            then=lambda: _accumulate(target, scratch, 1.0, self.counter))
        self._record(("reduce_scatter_accumulate", n, full.numel(), full.dtype, async_op), work if async_op else None)
        return work

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False,
                            then: Optional[Callable[[], object]] = None) -> Work:
        """Write this rank's slice of the mean of ``full`` over ranks into ``out`` (a device
        tensor of ``full``'s dtype) with the tensor collective; ``then`` runs once it is done."""
        self._check_usable(out, full)
        self.counter.collective("reduce_scatter", full.numel() * full.element_size(), self.world_size)
        handle = self._reduce_scatter_fn(out, full, op=dist.ReduceOp.AVG, group=self.reduce_group,
                                         async_op=async_op)
        work = Work(handle, then=then)
        self._record(("reduce_scatter_mean", out.numel(), full.numel(), full.dtype, async_op),
                     work if async_op else None)
        return work

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", tag: str = "") -> torch.Tensor:
        """In-place all-reduce of a small tensor (flags, norms), wherever it lives: NCCL
        reduces only device tensors, so host tensors make a round trip through the compute
        device (the one the groups were made for, not whatever device happens to be current).
        ``tag`` names the collective in the pass's schedule (schedule.END_BACKWARD)."""
        if self.distributed:
            self._record(("all_reduce", tensor.numel(), tensor.dtype, op, tag))
            self._check_usable()
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            self.counter.collective("all_reduce", tensor.numel() * tensor.element_size(), self.world_size)
            if tensor.device.type == self.device.type:
                dist.all_reduce(tensor, op=red, group=self.reduce_group)
            else:
                on_device = tensor.to(self.device)
                dist.all_reduce(on_device, op=red, group=self.reduce_group)
                tensor.copy_(on_device)
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` with the group's first rank's copy (so all ranks start equal)."""
        if self.distributed:
            self._check_usable()
            src = dist.get_global_rank(self.gather_group, 0)
            self.counter.collective("broadcast", tensor.numel() * tensor.element_size(), self.world_size,
                                    source=self.rank == 0)
            self._record(("broadcast_from_first", tensor.numel(), tensor.dtype))
            dist.broadcast(tensor, src=src, group=self.gather_group)
        return tensor
