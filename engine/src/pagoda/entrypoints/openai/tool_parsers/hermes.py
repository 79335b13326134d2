"""The ``hermes`` parser (Hermes, Qwen2/2.5/3): ``<tool_call>{json}</tool_call>`` blocks after optional content."""

from __future__ import annotations

from typing import Any, ClassVar

from pagoda.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCallStreamer,
    ToolParser,
    _call_parts,
    _MarkerStreamer,
    _plain,
    _try_parse,
)


class HermesToolParser(ToolParser):
    """Hermes / Qwen2 / Qwen2.5 / Qwen3: ``<tool_call>{json}</tool_call>`` blocks after optional content.

    Content is the text before the first block; text between and after blocks is dropped. Any block that is not
    a JSON object with a string ``name`` makes the whole output plain content. A final block cut off before its
    ``</tool_call>`` (length limit) still counts when its JSON is complete.
    """

    name: ClassVar[str] = "hermes"
    start: ClassVar[str] = "<tool_call>"
    end: ClassVar[str] = "</tool_call>"

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(self.start)
        if first < 0:
            return _plain(text)
        parts: list[tuple[str, dict[str, Any]]] = []
        start = first
        while start >= 0:
            body_start = start + len(self.start)
            end = text.find(self.end, body_start)
            part = _call_parts(_try_parse(text[body_start:] if end < 0 else text[body_start:end]))
            if part is None:
                return _plain(text)
            parts.append(part)
            if end < 0:
                break
            start = text.find(self.start, end + len(self.end))
        return self._result(text[:first], parts)

    def streamer(self) -> ToolCallStreamer:
        return _MarkerStreamer(self, self.start)
