"""What the tool-call parsers (:mod:`tool_parsers`) and the reasoning parsers (:mod:`reasoning_parsers`) share:
holding back a marker that may be arriving, and finding a parser by its ``--*-parser`` name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

P = TypeVar("P")


def partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker`` (it may become the marker)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def make_parser(registry: Mapping[str, Callable[[], P]], name: str, kind: str) -> P:
    """A new parser of ``registry`` registered as ``name``; ValueError naming the ``kind`` and the known names."""
    try:
        factory = registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; known parsers: {known}") from None
    return factory()
