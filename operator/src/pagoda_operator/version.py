"""The operator's version: the one source of truth, on the ground floor so that any module may read it."""

__version__ = "0.1.0"
