"""Exit hygiene for the plain reference runs (``accelerate launch`` without hf_elixir).

The tests compare hf_elixir against the same script under plain ``accelerate launch``. Such a
process can abort at interpreter teardown ("terminate called without an active exception",
SIGABRT) after it has trained and written its result: a gloo worker thread that outlived its
process group frees a tensor's Python object while the interpreter is being torn down
(``hf_elixir/integrations/process_exit.py`` has the mechanism and the backtrace). hf_elixir's
own processes end through that module; the reference runs get the same two steps from this
file, which ``integration_helpers.reference_env`` puts first on their ``PYTHONPATH``:

1. at a normal exit, the garbage is collected and the process groups destroyed;
2. the reference scripts run through ``run_reference.py``, which knows how the script ended
   and, if gloo worker threads survived step 1 (a DDP reducer still holds the group), ends
   the process with the script's own status before the teardown.

It changes nothing a run computes, and after an uncaught exception it does nothing, so a
failing reference still fails at once. The module is loaded by path, so a reference process
never imports the hf_elixir package.
"""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "hf_elixir" / "integrations" / "process_exit.py"
_spec = importlib.util.spec_from_file_location("reference_process_exit", _PATH)
process_exit = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = process_exit  # dataclasses resolve the module by name
_spec.loader.exec_module(process_exit)
process_exit.destroy_process_groups_at_exit()
