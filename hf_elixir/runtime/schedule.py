"""The collective schedule of a training pass, and finishing a pass hollowly after a failure.

Every rank issues the same collectives in the same order (fetch.py, reduce.py). When one
rank fails part-way through a pass (an out-of-memory error in the forward or the backward),
its peers are already waiting in, or about to issue, collectives that rank will never reach
along its normal path. Neither gloo nor NCCL lets it simply leave: a peer blocked in a
gather stays blocked (gloo has no working abort; destroying or shutting down a group on
one rank leaves the other's pending collective waiting), and a rank that leaves would hang
every later collective.

So the failing rank *finishes the pass hollowly*: it issues the rest of the pass's
collectives, with scratch buffers of the same sizes, in the order and with the waits its
own previous pass recorded, and its peers complete their pass normally. The last
collective of every backward (the reducer's small all-reduce of late chunks, tagged
``end_backward``) carries a failure flag; through it every rank learns, in the same pass,
that the pass failed. No collective is added to a pass that does not fail.

The schedule a hollow finish follows is one this rank recorded earlier for a pass that
started from the same state: which chunks held rCache blocks (in their order of last use),
which were gathered or in flight, and whether the rCache trace was known. From the same
state, the same model issues the same collectives (every decision in fetch.py and reduce.py
depends on that state and the request sequence only), and every rank starts each pass from
the same state, so the failing rank's record of that state is also its peers' schedule.
The failing rank's own events so far must match the record's beginning; when no record of
the state exists yet (the first pass from it, or the first after a re-plan), the failure
cannot be finished safely and is raised as it is (``ScheduleUnknown``).

Events are ``("issue", call, id)`` and ``("wait", id)``; ids count the pass's collectives
from its start (negative ids: collectives issued before the pass began, such as the gathers
the optimizer step prefetches), so two passes compare equal when they issued the same
calls with the same waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hf_elixir.vocab import HfElixirError

# The collectives (comm.py) record into a Schedule and a hollow finish calls them back, so
# this module names their types only in words: ``comm`` is a Collectives, a work a Work.

#: the tag of the collective that ends a backward and carries the failure flag
END_BACKWARD = "end_backward"
#: how many starting states keep a recorded schedule (a run cycles through a few: after an
#: optimizer step, between micro-batches, after an evaluation)
KEPT_STATES = 16


class ScheduleUnknown(HfElixirError, RuntimeError):
    pass


@dataclass
class Schedule:
    """Records each training pass's collectives; keeps the latest schedule from each starting state."""

    serial: int = 0                                  #: collectives issued so far
    live: dict[int, Any] = field(default_factory=dict)  #: async collectives not waited for
    recording: Optional[list[tuple]] = None          #: the pass now running
    state: Any = None                                #: the state it started from
    start: int = 0
    templates: dict[Any, list[tuple]] = field(default_factory=dict)

    # ------------------------------------------------------------------ recording
    def issued(self, call: tuple, work: Optional[Any]) -> None:
        """A collective was issued (``work``: its handle when asynchronous)."""
        n = self.serial
        self.serial += 1
        if work is not None:
            work.serial, work.schedule = n, self
            self.live[n] = work
        if self.recording is not None:
            self.recording.append(("issue", call, n - self.start))

    def waited(self, n: int) -> None:
        self.live.pop(n, None)
        if self.recording is not None:
            self.recording.append(("wait", n - self.start))

    def begin(self, state: Any) -> None:
        """A training pass starts from ``state`` (hashable); a pass left unfinished is
        forgotten."""
        self.recording, self.state, self.start = [], state, self.serial

    def end(self, keep: bool = True) -> None:
        """The pass's backward ended; ``keep=False`` after a failure (its schedule is not one
        a healthy pass repeats)."""
        events, self.recording = self.recording, None
        if events is None or not keep:
            return
        self.templates.pop(self.state, None)
        self.templates[self.state] = events
        while len(self.templates) > KEPT_STATES:
            self.templates.pop(next(iter(self.templates)))

    def forget(self) -> None:
        """Every schedule becomes unknown (a new plan: the same state leads elsewhere)."""
        self.recording = None
        self.templates.clear()

    # ------------------------------------------------------------------ the hollow finish
    def finish_hollow(self, comm: Any, failed_flag: int) -> None:
        """Issue the rest of the current pass's collectives with scratch buffers, as the
        schedule recorded from the same starting state did, setting ``failed_flag`` in the end-of-backward all-reduce;
        stop after that one (the rest of a failed backward is skipped by every rank)."""
        events, self.recording = self.recording, None
        template = self.templates.get(self.state)
        if events is None or template is None:
            raise ScheduleUnknown("no pass has started from this state before, so its schedule is unknown")
        done = len(events)
        if template[:done] != events:
            at = next((i for i, (a, b) in enumerate(zip(template, events)) if a != b), min(done, len(template)))
            seen = events[at] if at < done else "nothing"
            recorded = template[at] if at < len(template) else "the end"
            raise ScheduleUnknown(f"this pass left the recorded schedule before it failed (collective {at}: "
                                  f"{seen} where the record has {recorded})")
        replayed: dict[int, Any] = {}
        for event in template[done:]:
            if event[0] == "wait":
                work = replayed.pop(event[1], None) or self.live.pop(self.start + event[1], None)
                if work is not None:
                    work.wait()
                continue
            _, call, rel = event
            work = _hollow_call(comm, call, failed_flag)
            if work is not None:
                replayed[rel] = work
            if call[0] == "all_reduce" and call[-1] == END_BACKWARD:
                break
        for work in replayed.values():  # issued but waited only after the end
            work.wait()


def _hollow_call(comm: Any, call: tuple, failed_flag: int) -> Optional[Any]:
    """Make ``call`` again with zeros of its recorded sizes (recording nothing)."""
    kind, args = call[0], call[1:]
    dev = comm.device
    zeros = lambda n, dtype: torch.zeros(n, dtype=dtype, device=dev)  # noqa: E731
    with comm.not_recording():
        if kind == "all_gather":
            numel, dtype, async_op = args
            work = comm.all_gather(torch.empty(numel * comm.world_size, dtype=dtype, device=dev),
                                   zeros(numel, dtype), async_op=async_op)
            return work if async_op else None
        if kind == "reduce_scatter_accumulate":
            target_numel, full_numel, dtype, async_op = args
            scratch = zeros(target_numel, dtype) if comm.reduce_needs_scratch else None
            work = comm.reduce_scatter_accumulate(zeros(target_numel, torch.float32), zeros(full_numel, dtype),
                                                  scratch, async_op=async_op)
            return work if async_op else None
        if kind == "reduce_scatter_mean":
            out_numel, full_numel, dtype, async_op = args
            work = comm.reduce_scatter_mean(zeros(out_numel, dtype), zeros(full_numel, dtype), async_op=async_op)
            return work if async_op else None
        if kind == "all_reduce":
            numel, dtype, op, tag = args
            tensor = zeros(numel, dtype)
            if tag == END_BACKWARD:
                tensor[-1] = failed_flag
            comm.all_reduce(tensor, op=op, tag=tag)
            return None
        if kind == "broadcast_from_first":
            numel, dtype = args
            comm.broadcast_from_first(zeros(numel, dtype))
            return None
    raise ScheduleUnknown(f"hf_elixir internal error: no hollow form of the collective {kind!r}")

