"""Sharded safetensors checkpoints: atomic save, load at any world size or plan, export.

``save(emodel, eoptimizer, directory)`` and ``load(emodel, eoptimizer, directory)`` are
collective; ``export(directory, output)`` runs in one process without a process group and
writes a folder ``AutoModelForCausalLM.from_pretrained`` loads. The format is described in
``save.py`` and docs/checkpoints.md; ``load.py`` reshards through ``reshard.py``. Frozen weights (a PEFT base) are recorded by digest,
not stored, and a load refuses another base (``frozen.py``).
"""

from hf_elixir.checkpoint.errors import CheckpointError
from hf_elixir.checkpoint.export import export
from hf_elixir.checkpoint.index import FORMAT_VERSION
from hf_elixir.checkpoint.load import load
from hf_elixir.checkpoint.save import save

__all__ = ["save", "load", "export", "CheckpointError", "FORMAT_VERSION"]
