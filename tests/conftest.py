import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Calibrations are cached per machine (hardware.cache_path) and change what the planner
# chooses. The tests keep their own cache, new each session and removed after it, so a run
# behaves as on a fresh machine: it never reads a calibration measured earlier under other
# load (a loaded machine's figures changed the recovery tests' plans), nor writes the user's.
if "HF_ELIXIR_CACHE" not in os.environ:
    os.environ["HF_ELIXIR_CACHE"] = tempfile.mkdtemp(prefix="hf_elixir_test_cache_")
    atexit.register(shutil.rmtree, os.environ["HF_ELIXIR_CACHE"], ignore_errors=True)


def pytest_sessionstart(session) -> None:
    """Start the server the multi-process tests fork their ranks from (harness.py) before any
    test changes the environment; it imports torch and transformers while collection runs.

    Under pytest-xdist (``-n 2``, the README's command) each worker is a session of its own
    and starts its own server; the controller, which runs no test, starts none.
    """
    from harness import start_rank_server

    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        return
    start_rank_server()
