"""Run a plain reference script as ``python script.py args`` would, then end it safely.

    accelerate launch ... tests/reference_site/run_reference.py script.py [args...]

Step 2 of the reference runs' exit (sitecustomize.py): the script runs as ``__main__``
through ``process_exit.run_script``, which learns the script's exit status and, if gloo
worker threads outlived the process groups, ends the process with that status before the
interpreter's teardown can abort it.

Where the teardown does run, the last exit handler first freezes every object then alive out
of its cycle collections (``process_exit.freeze_for_teardown``): the reference scripts have
written their results by then, and the suite starts dozens of them.
"""

import atexit
import sys

import sitecustomize

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: run_reference.py script.py [args...]")
    atexit.register(sitecustomize.process_exit.freeze_for_teardown)  # before run_script's handler, so it runs after it
    sitecustomize.process_exit.run_script(sys.argv[1], sys.argv[2:])
