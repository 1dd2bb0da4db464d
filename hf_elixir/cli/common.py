"""What every hf-elixir command shares: its error and its exit statuses."""

from __future__ import annotations

from hf_elixir.vocab import HfElixirError

EXIT_OK, EXIT_INFEASIBLE, EXIT_USAGE = 0, 1, 2


class CLIError(HfElixirError):
    """A usage error: printed without a traceback, exit status 2."""
