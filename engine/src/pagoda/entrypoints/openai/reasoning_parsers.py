"""Reasoning parsers: split ``<think>...</think>`` output into ``reasoning_content`` and ``content``.

``--reasoning-parser NAME`` picks one:

- ``deepseek_r1``: the reasoning comes first. Its opening ``<think>`` may be missing (newer templates put it in the
  prompt), so everything up to ``</think>`` is reasoning, and output that never closes the block (cut by the length
  limit) is reasoning in full.
- ``qwen3``: thinking can be switched off (``enable_thinking=False``), and then the output carries no tags at all
  and is content in full. A leading ``<think>`` is optional (Qwen3-Thinking templates put it in the prompt), so
  text before a ``</think>`` is reasoning whether or not the output opened the block. The newlines the template
  writes after ``</think>`` are dropped from the content.

Both parsers only treat ``<think>`` as the opening tag at the very start of the output (after whitespace); one
later in the text is reasoning text like any other. Empty parts are None in ``extract()``.

Streaming returns, for any split of the output into chunks, exactly the parts ``extract()`` returns (None read as
""). Only text that may still be a partial tag is held back, with one exception: ``qwen3`` output that does not
open with ``<think>`` is reasoning if a ``</think>`` follows and content if none does, and that is unknowable
until one appears or the stream ends. Such output is held back whole until then. The serving layer can avoid the
wait where it knows thinking is off (``enable_thinking=False``) by not using a reasoning parser for the request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

from pagoda.entrypoints.openai.output_parsing import make_parser, partial_suffix_len

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStreamer",
    "get_reasoning_parser",
]

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningStreamer(ABC):
    """Per-choice state that splits streamed text deltas into reasoning and content deltas."""

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, str]:
        """Take the text generated since the last call; return the (reasoning, content) that can be emitted now."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """End of generation: return the (reasoning, content) still held back."""


class ReasoningParser(ABC):
    """A model family's reasoning syntax. One instance serves the whole server: it holds no per-request state."""

    name: ClassVar[str]

    @abstractmethod
    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """Split a whole (non-streamed) output into (reasoning, content); an empty part is None."""

    @abstractmethod
    def streamer(self) -> ReasoningStreamer:
        """Fresh streaming state for one choice."""


def _after_opening_tag(text: str) -> Optional[str]:
    """The text after a leading ``<think>`` (whitespace before it allowed), or None if the output has none."""
    head = text.lstrip()
    return head[len(THINK_START) :] if head.startswith(THINK_START) else None


class _ThinkTagParser(ReasoningParser):
    """``<think>reasoning</think>content``; the subclasses differ in what untagged output is."""

    # Output with neither a leading <think> nor a </think>: reasoning cut short (True) or plain content (False).
    untagged_is_reasoning: ClassVar[bool]
    # Drop the newlines that follow </think> from the content.
    strip_content_newlines: ClassVar[bool]

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        body = _after_opening_tag(text)
        tagged = body is not None
        if body is None:
            body = text
        reasoning, closed, content = body.partition(THINK_END)
        if closed:
            if self.strip_content_newlines:
                content = content.lstrip("\n")
            return reasoning or None, content or None
        if tagged or self.untagged_is_reasoning:
            return body or None, None
        return None, text or None

    def streamer(self) -> ReasoningStreamer:
        return _ThinkStreamer(self.untagged_is_reasoning, self.strip_content_newlines)


class DeepSeekR1ReasoningParser(_ThinkTagParser):
    """DeepSeek-R1 (and its distills): everything before ``</think>`` is reasoning, opening tag or not."""

    name: ClassVar[str] = "deepseek_r1"
    untagged_is_reasoning: ClassVar[bool] = True
    # The brief's R1 semantics (and vLLM's) keep the content verbatim after </think>.
    strip_content_newlines: ClassVar[bool] = False


class Qwen3ReasoningParser(_ThinkTagParser):
    """Qwen3: as DeepSeek-R1, except that untagged output without ``</think>`` is content (thinking was off)."""

    name: ClassVar[str] = "qwen3"
    untagged_is_reasoning: ClassVar[bool] = False
    strip_content_newlines: ClassVar[bool] = True


# Streamer states, in the order a stream moves through them.
_START = "start"  # deciding whether the output opens with <think>
_REASONING = "reasoning"  # inside the think block: reasoning until </think>
_UNDECIDED = "undecided"  # qwen3, untagged: reasoning if </think> follows, content otherwise
_AFTER_END = "after_end"  # just past </think>: dropping the template's newlines
_CONTENT = "content"  # everything from here on is content


class _ThinkStreamer(ReasoningStreamer):
    """The streaming twin of ``_ThinkTagParser.extract``: a small state machine over the states above."""

    def __init__(self, untagged_is_reasoning: bool, strip_content_newlines: bool) -> None:
        self._untagged_is_reasoning = untagged_is_reasoning
        self._strip_content_newlines = strip_content_newlines
        self._state = _START
        self._pending = ""  # start/reasoning: the few characters that may still be (part of) a tag
        self._blank: list[str] = []  # start: the whitespace before _pending
        self._held: list[str] = []  # undecided: all of the text, joined once (repeated += would be quadratic)
        self._tail = ""  # undecided: the last characters held, so a </think> split across chunks is found
        self._finished = False

    def feed(self, delta: str) -> tuple[str, str]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not delta:
            return "", ""
        if self._state == _START:
            return self._feed_start(delta)
        if self._state == _REASONING:
            return self._feed_reasoning(delta)
        if self._state == _UNDECIDED:
            return self._feed_undecided(delta)
        return self._feed_content(delta)

    def finish(self) -> tuple[str, str]:
        if self._finished:
            return "", ""
        self._finished = True
        if self._state == _START:
            # Only whitespace or a partial <think>: plain text, which untagged output is.
            text, self._pending, self._blank = "".join(self._blank) + self._pending, "", []
            return (text, "") if self._untagged_is_reasoning else ("", text)
        if self._state == _REASONING:
            text, self._pending = self._pending, ""
            return text, ""  # a partial </think> that never completed is reasoning text
        if self._state == _UNDECIDED:
            text, self._held = "".join(self._held), []
            return "", text  # no </think> came: thinking was off
        return "", ""

    def _feed_start(self, delta: str) -> tuple[str, str]:
        # _pending holds the text from its first non-whitespace character (a partial <think> at most); the
        # whitespace before it waits in _blank, so that a long run of it is not stripped again on every feed.
        if self._pending:
            head = self._pending + delta
        else:
            head = delta.lstrip()
            self._blank.append(delta[: len(delta) - len(head)])
        if head.startswith(THINK_START):
            self._pending, self._blank = "", []
            self._state = _REASONING
            return self._feed_reasoning(head[len(THINK_START) :])
        if THINK_START.startswith(head):
            self._pending = head
            return "", ""  # only whitespace or a partial <think> so far
        text, self._pending, self._blank = "".join(self._blank) + head, "", []
        if self._untagged_is_reasoning:
            self._state = _REASONING
            return self._feed_reasoning(text)
        self._state = _UNDECIDED
        return self._feed_undecided(text)

    def _feed_reasoning(self, delta: str) -> tuple[str, str]:
        self._pending += delta
        reasoning, closed, rest = self._pending.partition(THINK_END)
        if closed:
            self._pending = ""
            self._state = _AFTER_END
            return reasoning, self._feed_content(rest)[1]
        cut = len(self._pending) - partial_suffix_len(self._pending, THINK_END)
        reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        return reasoning, ""

    def _feed_undecided(self, delta: str) -> tuple[str, str]:
        window = self._tail + delta
        self._held.append(delta)
        if THINK_END not in window:
            self._tail = window[-(len(THINK_END) - 1) :]
            return "", ""
        # The first </think> of all the held text is this one: earlier windows covered every earlier position.
        reasoning, _, rest = "".join(self._held).partition(THINK_END)
        self._held, self._tail = [], ""
        self._state = _AFTER_END
        return reasoning, self._feed_content(rest)[1]

    def _feed_content(self, delta: str) -> tuple[str, str]:
        if self._state == _AFTER_END:
            if self._strip_content_newlines:
                delta = delta.lstrip("\n")
            if not delta:
                return "", ""
            self._state = _CONTENT
        return "", delta


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ValueError listing the known names otherwise."""
    return make_parser(REASONING_PARSERS, name, "reasoning parser")
