"""``InvalidSpec``, the error every spec check raises: below ``spec`` and ``spec_routing``, which both raise it."""

from __future__ import annotations


class InvalidSpec(ValueError):
    """A spec problem the schema cannot express; ``field`` is its path, e.g. ``spec.autoscaling.minReplicas``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)  # both in ``args``: the error copies and pickles like any ValueError

    @property
    def field(self) -> str:
        return str(self.args[0])

    @property
    def message(self) -> str:
        return str(self.args[1])

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"
