"""What the tool-call parsers share: the result types, call ids, JSON helpers, the parser and streamer ABCs, and
the generic streamers that hold the tool-call section back until ``finish()``."""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from pagoda.entrypoints.openai.output_parsing import partial_suffix_len

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text of an object, as OpenAI's API carries it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A whole output split into its content (None when there is none worth showing) and its tool calls."""

    content: Optional[str]
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A streamed piece of call ``index``: the first piece has ``id`` and ``name``, later ones only ``arguments``."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class DeltaMessage:
    """What one ``feed()``/``finish()`` adds to the streamed message."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


def _random_alnum(length: int) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(length))


def new_tool_call_id() -> str:
    """A fresh OpenAI-style call id: ``call_`` and 24 random alphanumerics."""
    return "call_" + _random_alnum(24)


def new_mistral_tool_call_id() -> str:
    """A fresh Mistral call id: 9 random alphanumerics (Mistral's chat templates reject any other shape)."""
    return _random_alnum(9)


def _reject_constant(name: str) -> Any:
    # json accepts NaN and Infinity, which are not JSON: re-serialising them would hand the client invalid JSON.
    raise ValueError(f"{name} is not valid JSON")


# strict=False: models write raw newlines and tabs inside string values (code arguments), which is harmless to
# accept because the arguments are re-serialised before they reach the client.
_DECODER = json.JSONDecoder(strict=False, parse_constant=_reject_constant)
_WHITESPACE = re.compile(r"\s*")


def parse_json(text: str) -> Any:
    """Parse ``text`` (surrounding whitespace allowed) as one JSON value; ValueError if it is not exactly one."""
    try:
        return _DECODER.decode(text)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def serialize_arguments(arguments: dict[str, Any]) -> str:
    """The ``arguments`` string of a call: JSON with the default separators, non-ASCII text kept unescaped."""
    return json.dumps(arguments, ensure_ascii=False)


def _try_parse(text: str) -> Any:
    """``parse_json`` that answers None for invalid text (JSON ``null`` is never a valid call either)."""
    try:
        return parse_json(text)
    except ValueError:
        return None


def _raw_decode(text: str, pos: int) -> Optional[tuple[Any, int]]:
    """The JSON value starting exactly at ``pos`` and the index just after it, or None."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def _skip_whitespace(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    return match.end() if match else pos


def _call_parts(obj: Any) -> Optional[tuple[str, dict[str, Any]]]:
    """(name, arguments) of a ``{"name": ..., "arguments"|"parameters": {...}}`` object, or None if it is not one.

    Missing arguments mean a call without parameters. Arguments given as a JSON string holding an object are
    accepted, because some fine-tunes double-encode them the way OpenAI's API does.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(arguments, str):
        arguments = _try_parse(arguments)
    if not isinstance(arguments, dict):
        return None
    return name, arguments


class ToolCallStreamer(ABC):
    """Per-choice state that turns streamed text deltas into content and tool-call deltas."""

    @abstractmethod
    def feed(self, delta: str) -> DeltaMessage:
        """Take the text generated since the last call; return what can be emitted now."""

    @abstractmethod
    def finish(self) -> DeltaMessage:
        """End of generation: return everything still held back (content and all tool calls)."""

    @property
    @abstractmethod
    def called_tools(self) -> bool:
        """Whether at least one tool call was emitted (the choice's finish_reason is then ``tool_calls``)."""


class ToolParser(ABC):
    """A model family's tool-call syntax. One instance serves the whole server: it holds no per-request state."""

    name: ClassVar[str]

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """Split a whole (non-streamed) output into content and tool calls."""

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """Fresh streaming state for one choice."""

    def new_id(self) -> str:
        """A fresh id for a call this parser found."""
        return new_tool_call_id()

    def _result(self, content: str, parts: list[tuple[str, dict[str, Any]]]) -> ExtractedToolCalls:
        # Only whitespace before the calls (the newline a template puts there) is no content worth showing.
        calls = tuple(ToolCall(self.new_id(), name, serialize_arguments(args)) for name, args in parts)
        return ExtractedToolCalls(content if content.strip() else None, calls)


def _plain(text: str) -> ExtractedToolCalls:
    return ExtractedToolCalls(text, ())


class MarkerToolParser(ToolParser):
    """A format whose tool-call section starts at ``marker`` after free content (``<tool_call>``, ``[TOOL_CALLS]``).

    The content is the text before the first marker; the subclass reads the calls of the section from there.
    """

    marker: ClassVar[str]

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(self.marker)
        if first < 0:
            return _plain(text)
        parts = self._section_calls(text, first)
        if parts is None:
            return _plain(text)
        return self._result(text[:first], parts)

    @abstractmethod
    def _section_calls(self, text: str, first: int) -> Optional[list[tuple[str, dict[str, Any]]]]:
        """The (name, arguments) of every call from the marker at ``first`` on, or None if any call is malformed
        (the whole output is then content)."""

    def streamer(self) -> ToolCallStreamer:
        return _MarkerStreamer(self, self.marker)


class _DeferredStreamer(ToolCallStreamer):
    """Streams content while it is certain, holds the tool-call section, and settles it with ``extract()``.

    Invariant: the content emitted by ``feed()`` is always a beginning of ``extract(full_text).content`` whatever
    follows, so ``finish()`` only has to emit the rest of that content and the calls.
    """

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._chunks: list[str] = []  # everything fed, joined once at finish() (repeated += would be quadratic)
        self._pending = ""  # text neither emitted nor known to be inside the tool-call section
        self._emitted = 0  # characters of content emitted so far
        self._in_section = False
        self._finished = False
        self._called = False

    def feed(self, delta: str) -> DeltaMessage:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._chunks.append(delta)
        if self._in_section or not delta:
            return DeltaMessage()
        self._pending += delta
        content = self._advance()
        self._emitted += len(content)
        return DeltaMessage(content=content)

    @abstractmethod
    def _advance(self) -> str:
        """Settle what of ``_pending`` is content now: update ``_pending``/``_in_section``, return that content."""

    def finish(self) -> DeltaMessage:
        if self._finished:
            return DeltaMessage()
        self._finished = True
        result = self._parser.extract("".join(self._chunks))
        rest = (result.content or "")[self._emitted :]
        calls = tuple(
            ToolCallDelta(index=i, id=call.id, name=call.name, arguments=call.arguments)
            for i, call in enumerate(result.tool_calls)
        )
        self._called = bool(calls)
        return DeltaMessage(content=rest, tool_calls=calls)

    @property
    def called_tools(self) -> bool:
        return self._called


class _MarkerStreamer(_DeferredStreamer):
    """For formats whose calls start at a marker (``<tool_call>``, ``[TOOL_CALLS]``) after free content."""

    def __init__(self, parser: ToolParser, marker: str) -> None:
        super().__init__(parser)
        self._marker = marker
        # Whitespace-only content held before anything else: kept aside rather than in ``_pending``, so that a
        # long run of it (a model emitting blank lines) is not scanned again on every feed (quadratic).
        self._blank: list[str] = []

    def _advance(self) -> str:
        at = self._pending.find(self._marker)
        if at >= 0:
            candidate, rest = self._pending[:at], ""
            self._in_section = True
        else:
            # A partial marker at the end stays pending: it is never content if the marker completes.
            cut = len(self._pending) - partial_suffix_len(self._pending, self._marker)
            candidate, rest = self._pending[:cut], self._pending[cut:]
        self._pending = rest
        if self._emitted == 0 and not candidate.strip():
            # Whitespace-only content before calls is reported as None, so it waits for real text (or finish()).
            # (A marker never starts with whitespace, so none can begin inside what is set aside.)
            if self._in_section:
                self._blank = []
            else:
                self._blank.append(candidate)
            return ""
        if self._blank:
            candidate, self._blank = "".join(self._blank) + candidate, []
        return candidate
