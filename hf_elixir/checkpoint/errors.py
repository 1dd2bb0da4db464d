"""The one error checkpoints raise: it names the file and says what to do."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, loaded or exported as asked; nothing was changed."""
