"""The one error checkpoints raise: it names the file and says what to do."""


from hf_elixir.vocab import HfElixirError


class CheckpointError(HfElixirError, RuntimeError):
    """A checkpoint cannot be saved, loaded or exported as asked; nothing was changed."""
