"""Run a plain reference script as ``python script.py args`` would, then end it safely.

    accelerate launch ... tests/reference_site/run_reference.py script.py [args...]

Step 2 of the reference runs' exit (sitecustomize.py): the script runs as ``__main__``
through ``process_exit.run_script``, which learns the script's exit status and, if gloo
worker threads outlived the process groups, ends the process with that status before the
interpreter's teardown can abort it.
"""

import sys

import sitecustomize

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: run_reference.py script.py [args...]")
    sitecustomize.process_exit.run_script(sys.argv[1], sys.argv[2:])
