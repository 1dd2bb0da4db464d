"""Injected out-of-memory errors: the recovery path, testable without a GPU.

``ELIXIR_INJECT_OOM`` names where a ``torch.OutOfMemoryError`` should be raised, as a
comma-separated list of ``STEP:PHASE[:RANK]`` entries:

* ``STEP``: the optimizer step the failure belongs to, counted from 0 (the forward and
  backward passes before the first ``step()`` belong to step 0);
* ``PHASE``: ``forward`` (as the first fetch unit of a training forward starts),
  ``backward`` (as the first parameter gradient of a backward arrives) or ``optimizer``
  (as the update of the step begins);
* ``RANK``: the rank that fails (default: every rank).

``ELIXIR_INJECT_OOM=3:forward:1,5:backward`` makes rank 1 fail in the forward of step 3 and
every rank in the backward of step 5. Each entry fires once, in the first pass of its step
that reaches the phase; a redone step does not fail again. The error is raised where a real
allocation failure would surface, inside the model's forward or the autograd engine, so the
recovery handles it exactly as it would handle a real one.

When the variable is unset, ``FaultInjector.from_env`` returns None and the runtime checks
nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from hf_elixir.vocab import HfElixirError

INJECT_ENV = "ELIXIR_INJECT_OOM"
PHASES = ("forward", "backward", "optimizer")


class FaultSpecError(HfElixirError, ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    step: int
    phase: str
    rank: Optional[int] = None  #: None: every rank


def parse_faults(text: str) -> list[Fault]:
    """``STEP:PHASE[:RANK],...`` as Faults; a malformed entry raises, naming it."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        ok = len(parts) in (2, 3) and parts[0].isdigit() and parts[1] in PHASES and (
            len(parts) == 2 or parts[2].isdigit())
        if not ok:
            raise FaultSpecError(
                f"{INJECT_ENV}: {entry!r} is not STEP:PHASE[:RANK] (STEP and RANK whole numbers, "
                f"PHASE one of {', '.join(PHASES)}), e.g. 3:forward:1")
        out.append(Fault(int(parts[0]), parts[1], int(parts[2]) if len(parts) == 3 else None))
    return out


@dataclass
class FaultInjector:
    """The faults still to fire on this rank."""

    rank: int
    pending: list[Fault] = field(default_factory=list)
    fired: list[Fault] = field(default_factory=list)

    @classmethod
    def from_env(cls, rank: int) -> Optional["FaultInjector"]:
        text = os.environ.get(INJECT_ENV, "").strip()
        if not text:
            return None
        mine = [f for f in parse_faults(text) if f.rank is None or f.rank == rank]
        return cls(rank=rank, pending=mine)

    def check(self, step: int, phase: str) -> None:
        """Raise the injected error if one is due at this step and phase on this rank."""
        for fault in self.pending:
            if fault.step == step and fault.phase == phase:
                self.pending.remove(fault)
                self.fired.append(fault)
                raise torch.OutOfMemoryError(
                    f"hf_elixir: injected out-of-memory error ({INJECT_ENV}: step {step}, {phase}, "
                    f"rank {self.rank})")
