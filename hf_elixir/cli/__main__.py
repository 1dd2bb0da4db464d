"""``python -m hf_elixir.cli``: the same as the ``hf-elixir`` command."""

from hf_elixir.cli import run

run()
