"""The ``llama3_json`` parser (Llama 3.1/3.2): ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]*``."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from pagoda.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCallStreamer,
    ToolParser,
    _call_parts,
    _DeferredStreamer,
    _plain,
    _raw_decode,
    _skip_whitespace,
)


class _LeadingJsonStreamer(_DeferredStreamer):
    """For llama3_json: the output either opens with a JSON object (a call) or is content in full.

    While undecided, only the deciding head is kept (a partial tag, at most ``len(tag)`` characters): the
    whitespace around it is held in ``_held`` and never scanned twice, so a long run of it stays linear."""

    def __init__(self, parser: ToolParser, tag: str) -> None:
        super().__init__(parser)
        self._tag = tag
        self._is_content = False
        self._held: list[str] = []  # all text while undecided, joined once if it turns out to be content
        self._head = ""  # a partial tag seen so far (after leading whitespace)
        self._after_tag = False

    def _advance(self) -> str:
        if not self._is_content:
            delta, self._pending = self._pending, ""
            self._held.append(delta)
            decision = self._decide(delta)
            if decision is None:
                return ""  # only whitespace or a partial tag so far
            if decision == "call":
                self._in_section, self._held = True, []
                return ""
            self._is_content = True
            self._pending, self._held = "".join(self._held), []
        content, self._pending = self._pending, ""
        return content

    def _decide(self, delta: str) -> Optional[str]:
        """ "call" or "content" once the text so far shows which, else None."""
        if self._after_tag:
            text = delta.lstrip()
        else:
            text = self._head + delta if self._head else delta.lstrip()
            if text.startswith(self._tag):
                self._after_tag, self._head = True, ""
                text = text[len(self._tag) :].lstrip()
            elif self._tag.startswith(text):
                self._head = text
                return None
        if not text:
            return None
        return "call" if text.startswith("{") else "content"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling: ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]*``.

    Output whose stripped text (after the optional tag) does not open with ``{`` is content. Otherwise every
    object must be a call and nothing but whitespace and ``;`` separators may surround them, or the whole output
    is content.
    """

    name: ClassVar[str] = "llama3_json"
    tag: ClassVar[str] = "<|python_tag|>"

    def extract(self, text: str) -> ExtractedToolCalls:
        head = text.lstrip()
        if head.startswith(self.tag):
            head = head[len(self.tag) :]
        parts = _parse_call_sequence(head)
        if not parts:
            return _plain(text)
        return self._result("", parts)

    def streamer(self) -> ToolCallStreamer:
        return _LeadingJsonStreamer(self, self.tag)


def _parse_call_sequence(text: str) -> Optional[list[tuple[str, dict[str, Any]]]]:
    """Calls of ``{...} ; {...} ...`` (a trailing ``;`` allowed), or None if ``text`` is anything else."""
    pos = _skip_whitespace(text, 0)
    if not text.startswith("{", pos):
        return None
    parts = []
    while True:
        decoded = _raw_decode(text, pos)
        part = _call_parts(decoded[0]) if decoded else None
        if decoded is None or part is None:
            return None
        parts.append(part)
        pos = _skip_whitespace(text, decoded[1])
        if pos < len(text) and text[pos] == ";":
            pos = _skip_whitespace(text, pos + 1)
        elif pos < len(text):
            return None
        if pos == len(text):
            return parts
