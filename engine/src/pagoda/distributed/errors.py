"""Errors of the tensor-parallel runtime."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank ended, or stopped answering, while the engine needed it: the engine cannot go on."""
