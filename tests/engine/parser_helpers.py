"""Shared by the tool-call and reasoning parser tests: outputs cut into random stream chunks."""

from __future__ import annotations

from hypothesis import strategies as st


def split(data: st.DataObject, text: str) -> list[str]:
    """``text`` cut at random places (sometimes one character per chunk)."""
    if data.draw(st.booleans()):
        return list(text) or [""]
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
