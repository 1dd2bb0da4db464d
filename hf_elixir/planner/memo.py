"""The last few searches' candidates, kept for a plan that asks for the same ones again.

A candidate's predicted memory and time do not depend on the budget
(``search.enumerate_candidates``), and pricing them is most of a plan's time. Plans of one
profile at several budgets (a sweep in a notebook or a test, ``auto_find_batch_size``'s
second look at a micro-batch) and ``candidate_plans`` after ``plan`` would price the same
candidates each time; the memo prices them once.

An entry is found by the profile object itself, held weakly (the entry goes when the profile
does, and a new profile at a dead one's address is never taken for it), with the same
parameters, batch and trace as when it was priced (a profile changed in place is priced
again), and by equal hardware figures and search arguments. The candidates are shared by
every plan that recalls them, so nothing downstream may change one in place: ``disk.place``
copies what it changes.
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

from hf_elixir.hardware import HardwareProfile
from hf_elixir.profile.profiler import ModelProfile

#: entries kept: a sweep needs one; a few cover plans of a model and its adapter side by side
KEEP = 4


def _fingerprint(profile: ModelProfile) -> tuple:
    """What of a profile the search reads and a caller could change in place."""
    passes = (profile.plain, profile.checkpointed)
    return (tuple((p.name, p.numel, p.frozen) for p in profile.params), profile.buffer_bytes, profile.batch_size,
            profile.seq_len, profile.dtype, tuple(None if s is None else len(s.trace.events) for s in passes))


class CandidateMemo:
    """``recall(profile, hw, args, price)``: ``price()``'s result for these arguments, priced
    once while the profile lives (the ``KEEP`` most recent)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._entries: OrderedDict[tuple, tuple[weakref.ref, tuple, HardwareProfile, Any]] = OrderedDict()
        self.priced = 0  # how many times it had to price (a test reads it)

    def recall(self, profile: ModelProfile, hw: HardwareProfile, args: Hashable, price: Callable[[], Any]) -> Any:
        key = (id(profile), args)
        fingerprint = _fingerprint(profile)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is profile and entry[1] == fingerprint and entry[2] == hw:
            self._entries.move_to_end(key)
            return entry[3]
        value = price()
        self.priced += 1
        # the entry goes with its profile: a training process that planned once holds no
        # candidates once it has dropped the profile
        gone = weakref.ref(profile, lambda _, entries=self._entries, key=key: entries.pop(key, None))
        self._entries[key] = (gone, fingerprint, copy.deepcopy(hw), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.keep:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
