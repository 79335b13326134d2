"""The ``mistral`` parser: ``[TOOL_CALLS]`` then a JSON array of calls or ``name[ARGS]{...}`` segments."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Optional

from pagoda.entrypoints.openai.tool_parsers.base import (
    MarkerToolParser,
    _call_parts,
    _raw_decode,
    _skip_whitespace,
    new_mistral_tool_call_id,
)

# A v11+ call: the name, an optional [CALL_ID]<id> (v13 templates, the id is replaced by ours), an optional
# [ARGS] (absent when the tokenizer drops special tokens while decoding), then the JSON arguments.
# Every repeat is possessive (``*+``, ``++``): no run of the name or of whitespace can match two ways, and
# backtracking into adjacent ``\s*`` runs made a long whitespace run in model output quadratic (100 kB: 45 s).
_MISTRAL_CALL_HEAD = re.compile(
    r"\s*+([A-Za-z0-9_.\-]++)\s*+(?:\[CALL_ID\]\s*+[A-Za-z0-9]++\s*+)?(?:\[ARGS\])?\s*+(?=\{)"
)


class MistralToolParser(MarkerToolParser):
    """Mistral: content, then ``[TOOL_CALLS]`` and either a JSON array of calls or ``name[ARGS]{...}`` segments.

    Each ``[TOOL_CALLS]`` segment holds a JSON array (text after the closed array is dropped) or one or more
    ``name[ARGS]{...}`` calls with nothing else around them. Anything else makes the whole output content.
    """

    name: ClassVar[str] = "mistral"
    marker: ClassVar[str] = "[TOOL_CALLS]"

    def _section_calls(self, text: str, first: int) -> Optional[list[tuple[str, dict[str, Any]]]]:
        parts: list[tuple[str, dict[str, Any]]] = []
        for segment in text[first + len(self.marker) :].split(self.marker):
            segment_parts = _parse_mistral_segment(segment)
            if segment_parts is None:
                return None
            parts.extend(segment_parts)
        return parts

    def new_id(self) -> str:
        return new_mistral_tool_call_id()


def _parse_mistral_segment(segment: str) -> Optional[list[tuple[str, dict[str, Any]]]]:
    """The calls of the text after one ``[TOOL_CALLS]``, or None if it is not a well-formed segment."""
    pos = _skip_whitespace(segment, 0)
    if segment.startswith("[", pos):
        decoded = _raw_decode(segment, pos)
        if decoded is None or not isinstance(decoded[0], list) or not decoded[0]:
            return None
        array_parts = [part for part in map(_call_parts, decoded[0]) if part is not None]
        return array_parts if len(array_parts) == len(decoded[0]) else None
    parts = []
    while pos < len(segment):
        head = _MISTRAL_CALL_HEAD.match(segment, pos)
        decoded = _raw_decode(segment, head.end()) if head else None
        if head is None or decoded is None or not isinstance(decoded[0], dict):
            return None
        parts.append((head.group(1), decoded[0]))
        pos = _skip_whitespace(segment, decoded[1])
    return parts or None
