"""Exit hygiene for the plain reference runs (``accelerate launch`` without hf_elixir).

The tests compare hf_elixir against the same script under plain ``accelerate launch``. Such a
process, like any that reaches interpreter shutdown with gloo process groups alive, can abort
there ("terminate called without an active exception", SIGABRT) after it has trained and
written its result (pytorch/pytorch#190489). hf_elixir's own processes destroy their groups at
exit (``integrations/accelerate._finish_process_groups_at_exit``); the reference runs get the
same treatment from this file, which ``integration_helpers.accelerate_launch`` puts on their
``PYTHONPATH``, so a reference that finished its work does not fail the test at teardown.

It changes nothing a run computes: it only destroys the default process group at a normal
exit, the step a careful script would take itself. After an uncaught exception it does
nothing, so a failing reference still fails at once.
"""

import atexit
import sys

_uncaught = {"seen": False}
_previous_hook = sys.excepthook


def _note_uncaught(kind, value, tb):
    _uncaught["seen"] = True
    _previous_hook(kind, value, tb)


def _destroy_groups() -> None:
    if _uncaught["seen"] or "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


sys.excepthook = _note_uncaught
atexit.register(_destroy_groups)
