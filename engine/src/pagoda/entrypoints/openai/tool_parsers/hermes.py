"""The ``hermes`` parser (Hermes, Qwen2/2.5/3): ``<tool_call>{json}</tool_call>`` blocks after optional content."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from pagoda.entrypoints.openai.tool_parsers.base import MarkerToolParser, _call_parts, _try_parse


class HermesToolParser(MarkerToolParser):
    """Hermes / Qwen2 / Qwen2.5 / Qwen3: ``<tool_call>{json}</tool_call>`` blocks after optional content.

    Content is the text before the first block; text between and after blocks is dropped. Any block that is not
    a JSON object with a string ``name`` makes the whole output plain content. A final block cut off before its
    ``</tool_call>`` (length limit) still counts when its JSON is complete.
    """

    name: ClassVar[str] = "hermes"
    marker: ClassVar[str] = "<tool_call>"
    end: ClassVar[str] = "</tool_call>"

    def _section_calls(self, text: str, first: int) -> Optional[list[tuple[str, dict[str, Any]]]]:
        parts: list[tuple[str, dict[str, Any]]] = []
        start = first
        while start >= 0:
            body_start = start + len(self.marker)
            end = text.find(self.end, body_start)
            part = _call_parts(_try_parse(text[body_start:] if end < 0 else text[body_start:end]))
            if part is None:
                return None
            parts.append(part)
            if end < 0:
                break
            start = text.find(self.marker, end + len(self.end))
        return parts
