"""Saved activations of a block moved to host memory after its forward and back before its backward.

A block whose plan policy is ``recompute_offload`` or ``offload`` (``ElixirPlan.block_policies``;
``runtime/block_policies.py`` wires each block to this) runs its forward inside
``ActivationOffloader.block()``: a ``saved_tensors_hooks`` context whose pack hook takes every
tensor autograd saves there. Under ``recompute_offload`` the block is checkpointed, so what
autograd saves is the block's input (the checkpoint keeps nothing else); under ``offload``
it is everything the block's backward reads. The tensors of one call of one block form a
*group*:

- **Forward.** The group's tensors stay on the device while the block runs (its own
  operations read them). When the block's forward ends they are copied to host memory
  (pinned, on a copy stream of their own after the kernels that made them, with an event,
  on a CUDA device) and the device keeps them only until the next block's forward ends:
  then the compute stream waits for the copy's event (the host never does) and the device
  copies are dropped. So at most two groups are on the device in forward: the block running
  and the one whose copy is in flight.
- **Backward.** Blocks run their backward in the reverse of the forward's order. When
  autograd first asks for a tensor of group k (the recompute of a checkpointed block reads
  its input first), the group's tensors must be on the device: prefetched (the compute stream
  waits for their copy's event), or still there (the last block's, never dropped), or, if
  neither, copied up now on the compute stream. The group before it in forward order (k-1)
  then starts coming up on the copy stream, so its copy runs while block k recomputes and
  runs its backward; and the groups that were in use before k are dropped from the device.
  At most two groups are on the device in backward too: the one in use and the one coming.
- At the end of a backward that used a group (an autograd engine callback) its device and
  host copies are freed: nothing reads them again (a second backward through the same graph
  raises, naming the cause). A group whose graph is dropped without a backward frees its
  copies with it.

Parameters and views of parameters are left where they are: autograd saves the parameter
itself, whose chunk the runtime gathers again before the backward (``hooks.py``). So are
tensors on another device, empty ones, and ones whose layout a dense copy would not keep
(expanded views). Every copy keeps its tensor's strides, and a tensor saved twice in one
group is copied once, so the backward reads exactly the values and layouts it would have
read from the device: training is bit for bit that of the same blocks without offloading.

On a CPU compute device the "host" copies are other allocations of the same memory, made
synchronously: nothing is saved, but the mechanism, its order and its accounting run as on
a GPU, which is how the tests check them. The bytes of offloaded blocks' saved tensors on
the device are the ledger's ``offloaded_activations``; ``report()`` adds how many groups are
on the device now and at most, the bytes of the host copies now and at most, and the
copies made.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from hf_elixir.runtime.ledger import MemoryLedger

LEDGER_CATEGORY = "offloaded_activations"


@dataclass
class _Entry:
    """One saved tensor of a group: on the device while held, in host memory once copied."""

    device: Optional[torch.Tensor]
    host: Optional[torch.Tensor] = None
    nbytes: int = 0


@dataclass
class _Held:
    """The device and host bytes a group holds; kept apart from the group so that the
    group's finalizer can settle the counts without keeping the group alive."""

    nbytes: int = 0
    host_nbytes: int = 0


@dataclass(eq=False)
class _Group:
    """The saved tensors of one call of one block, in the order they were saved."""

    name: str
    entries: list[_Entry] = field(default_factory=list)
    by_key: dict[tuple, _Entry] = field(default_factory=dict)
    held: _Held = field(default_factory=_Held)
    closed: bool = False
    out_event: Any = None      # the copy to the host (CUDA), until the compute stream waits for it
    in_event: Any = None       # the copy back (CUDA), until the compute stream waits for it
    prev: Optional["weakref.ReferenceType[_Group]"] = None  # the group closed before it
    used: bool = False         # a backward has read it
    freed: bool = False        # that backward ended: its copies are gone

    def __hash__(self) -> int:
        return id(self)


@dataclass(eq=False)
class _Packed:
    """What autograd keeps for a saved tensor of an offloaded block."""

    group: _Group
    entry: _Entry


@dataclass
class OffloadCounts:
    """What the offloader did since it was made (``report()``)."""

    copies_out: int = 0        # tensors copied to the host
    copies_in: int = 0         # tensors copied back
    prefetched_groups: int = 0  # groups brought back ahead of their backward
    waited_groups: int = 0     # groups a backward reached before they were on the device
    bytes_out: int = 0
    bytes_in: int = 0


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory exactly once in some order of its dimensions
    (``empty_like`` then gives a copy the same strides)."""
    if t.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


class ActivationOffloader:
    """Moves the saved tensors of offloaded blocks between the device and host memory.

    Args:
        device: the compute device.
        ledger: the runtime's ledger (``offloaded_activations``).
        copy_stream: the stream copies run on (default: a new one on a CUDA device; on a CPU
            none, and copies are synchronous).
    """

    def __init__(self, device: torch.device, ledger: MemoryLedger, copy_stream: Any = None) -> None:
        self.device = device
        self.ledger = ledger
        #: on a CUDA device, a stream of its own: the parameters' uploads
        #: have theirs, and activations coming up in backward would queue behind them
        self.copy_stream = copy_stream
        if copy_stream is None and device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(device)
        self.pin = device.type == "cuda"
        self.counts = OffloadCounts()
        self.blocks_on_device = 0
        self.peak_blocks_on_device = 0
        #: bytes of host copies alive now and at most (what pinned host memory must hold)
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self._open: list[_Group] = []
        self._last_closed: Optional[weakref.ReferenceType[_Group]] = None
        self._unsettled: list[weakref.ReferenceType[_Group]] = []  # closed, copies out not waited for
        self._in_use: list[weakref.ReferenceType[_Group]] = []     # on the device for the running backward
        self._used: list[weakref.ReferenceType[_Group]] = []       # read by the running backward
        self._callback_queued = False

    # ------------------------------------------------------------------ forward
    @contextlib.contextmanager
    def block(self, name: str) -> Iterator[None]:
        """Run one block's forward with what autograd saves inside going to host memory."""
        if self._callback_queued and torch._C._current_graph_task_id() == -1:
            self._end_backward()  # the last backward raised before its end callback ran
        group = _Group(name)
        weakref.finalize(group, self._forget, group.held)
        self._open.append(group)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._open.remove(group)
            self._close(group)

    def _keeps(self, t: torch.Tensor) -> bool:
        """Whether ``t`` stays as it is (see the module docstring)."""
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        if t.numel() == 0 or t.device.type != self.device.type or not is_dense(t):
            return True
        return self.device.type == "cuda" and t.device != self.device

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._open or self._keeps(t):
            return t
        group = self._open[-1]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        entry = group.by_key.get(key)
        if entry is None:
            # detached: the group must not hold the graph (an output saved by its own node)
            entry = _Entry(t.detach(), nbytes=t.numel() * t.element_size())
            group.by_key[key] = entry
            group.entries.append(entry)
            self._account(group, entry.nbytes)
        return _Packed(group, entry)

    def _close(self, group: _Group) -> None:
        """The block's forward is over: its tensors start for the host; the group before it,
        whose copy has had a whole block's forward to finish, leaves the device."""
        group.closed = True
        group.by_key = {}  # the keys' storages may be reused once the device copies go
        if not group.entries:
            return
        self._copy(group, to_host=True)
        for ref in self._unsettled:
            older = ref()
            if older is not None:
                self._drop_device(older)
        self._unsettled = [weakref.ref(group)]
        group.prev = self._last_closed
        self._last_closed = weakref.ref(group)

    # ------------------------------------------------------------------ backward
    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        group, entry = packed.group, packed.entry
        if group.closed and not group.used:
            self._enter_backward(group)
        if entry.device is not None:
            return entry.device
        if group.freed or entry.host is None:
            raise RuntimeError(
                f"hf_elixir: the saved activations of block {group.name!r} were offloaded to host memory "
                "and freed when the backward that used them ended; a second backward through the same "
                "graph (retain_graph=True) needs that block's policy to be 'keep' or 'recompute'")
        return entry.host.to(self.device, non_blocking=True)  # a read after the group left (odd order)

    def _enter_backward(self, group: _Group) -> None:
        """The backward reached ``group``: have it on the device, drop the groups it is done
        with, and start bringing up the one it reaches next."""
        group.used = True
        self._used.append(weakref.ref(group))
        self._queue_end_callback()
        for ref in self._in_use:
            done = ref()
            if done is not None and done is not group:
                self._drop_device(done)
        self._in_use = [weakref.ref(group)]
        self._wait(group)  # a prefetch in flight (or the copy out, for the group still here)
        if any(e.device is None for e in group.entries):
            self.counts.waited_groups += 1
            self._copy(group, to_host=False, current=True)
        before = group.prev() if group.prev is not None else None
        if before is not None and not before.used and any(e.device is None for e in before.entries):
            self.counts.prefetched_groups += 1
            self._copy(before, to_host=False)
            self._in_use.append(weakref.ref(before))

    def _queue_end_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """Free the copies of every group this backward read (nothing reads them again)."""
        self._callback_queued = False
        for ref in self._in_use:
            group = ref()
            if group is not None:
                self._drop_device(group)
        for ref in self._used:
            group = ref()
            if group is not None:
                self._free_host(group)
        self._in_use, self._used = [], []

    def _free_host(self, group: _Group) -> None:
        group.freed = True
        for entry in group.entries:
            if entry.host is not None:
                entry.host = None
                self._account_host(group, -entry.nbytes)

    # ------------------------------------------------------------------ copies and waits
    def _copy(self, group: _Group, to_host: bool, current: bool = False) -> None:
        """Copy ``group``'s tensors to the host (after the kernels that made them), or the
        missing ones back to the device; on the copy stream, with an event, unless
        ``current`` (the compute stream: the backward needs them now) or on a CPU.

        Device memory for the copies back is taken on the compute stream, which reads and
        frees it: taken on the copy stream, the allocator would hand it out there again as
        soon as it was freed, while the compute stream might still be reading it."""
        if to_host:
            pairs = [(e.device, torch.empty_like(e.device, device="cpu", pin_memory=self.pin))
                     for e in group.entries]
            for entry, (_, host) in zip(group.entries, pairs):
                entry.host = host
                self._account_host(group, entry.nbytes)
        else:
            pairs = []
            for entry in group.entries:
                if entry.device is None:
                    entry.device = torch.empty_like(entry.host, device=self.device)
                    self._account(group, entry.nbytes)
                    pairs.append((entry.host, entry.device))
        stream = None if current else self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after what made them
            context = torch.cuda.stream(stream)                         # or last used the memory
        else:
            context = contextlib.nullcontext()
        with context:
            for source, target in pairs:
                target.copy_(source, non_blocking=self.pin)
            event = stream.record_event() if stream is not None else None
        moved = sum(target.numel() * target.element_size() for _, target in pairs)
        if to_host:
            self.counts.copies_out += len(pairs)
            self.counts.bytes_out += moved
            group.out_event = event
        else:
            self.counts.copies_in += len(pairs)
            self.counts.bytes_in += moved
            if event is not None:
                group.in_event = event

    def _wait(self, group: _Group) -> None:
        """Order the compute stream after ``group``'s copies in flight (no host wait)."""
        compute = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        for attr in ("out_event", "in_event"):
            event = getattr(group, attr)
            if event is not None:
                compute.wait_event(event)
                setattr(group, attr, None)

    def _drop_device(self, group: _Group) -> None:
        """Drop ``group``'s device copies once no copy in flight reads or writes them."""
        self._wait(group)
        for entry in group.entries:
            if entry.device is not None and entry.host is not None:
                entry.device = None
                self._account(group, -entry.nbytes)

    # ------------------------------------------------------------------ accounting
    def _account(self, group: _Group, nbytes: int) -> None:
        before = group.held.nbytes
        group.held.nbytes += nbytes
        if nbytes > 0:
            self.ledger.add(LEDGER_CATEGORY, nbytes)
        else:
            self.ledger.sub(LEDGER_CATEGORY, -nbytes)
        if before == 0 and group.held.nbytes > 0:
            self.blocks_on_device += 1
            self.peak_blocks_on_device = max(self.peak_blocks_on_device, self.blocks_on_device)
        elif before > 0 and group.held.nbytes == 0:
            self.blocks_on_device -= 1

    def _account_host(self, group: _Group, nbytes: int) -> None:
        group.held.host_nbytes += nbytes
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def _forget(self, held: _Held) -> None:
        """A group died (its graph was freed) with bytes still counted."""
        self.host_bytes -= held.host_nbytes
        held.host_nbytes = 0
        if held.nbytes:
            self.ledger.sub(LEDGER_CATEGORY, held.nbytes)
            held.nbytes = 0
            self.blocks_on_device -= 1

    def report(self) -> dict:
        """Groups (block calls) whose saved tensors are on the device now and at most, the
        bytes of their host copies now and at most, and the copies made (``OffloadCounts``)."""
        return {"blocks_on_device": self.blocks_on_device, "peak_blocks_on_device": self.peak_blocks_on_device,
                "host_bytes": self.host_bytes, "peak_host_bytes": self.peak_host_bytes, **vars(self.counts)}


__all__ = ["ActivationOffloader", "LEDGER_CATEGORY", "OffloadCounts", "is_dense"]
