"""One chat choice's generated text as OpenAI's assistant message: reasoning, content and tool calls.

The same rules apply to a whole text (``message``) and to a stream of deltas (``delta`` ... ``finish``), so a
streamed answer reassembles into the non-streamed one. Tool calls come from the ``--tool-call-parser`` when
``tool_choice`` is auto, and from the grammar-constrained output itself when it is ``required`` (a JSON array
of ``{"name", "parameters"}``) or names one tool (the arguments object).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagoda.entrypoints.openai.reasoning_parsers import THINK_START, ReasoningParser
from pagoda.entrypoints.openai.tool_choice import named_tool_call, parse_required_output
from pagoda.entrypoints.openai.tool_parsers import ToolCall, ToolCallDelta, ToolParser, new_tool_call_id


@dataclass(frozen=True, slots=True)
class ChatOutputConfig:
    """How a request's outputs are read: its tool choice (``none | auto | required | named``), the tool a
    named choice forces, and the server's parsers (None: not configured)."""

    tool_mode: str = "none"
    tool_name: Optional[str] = None
    tool_parser: Optional[ToolParser] = None
    reasoning_parser: Optional[ReasoningParser] = None
    # The output was shaped by a grammar from its first token: it holds reasoning only if it opens a <think>
    # block itself (a parser that reads untagged text as reasoning, deepseek_r1's, must not see the rest).
    constrained: bool = False
    # The message's role: --response-role, or the last message's role when the template adds no generation prompt.
    role: str = "assistant"

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole generated text."""
        reasoning_parser = self.reasoning_parser
        if self.constrained and not text.lstrip().startswith(THINK_START):
            reasoning_parser = None
        reasoning, content = reasoning_parser.extract(text) if reasoning_parser else (None, text)
        calls: tuple[ToolCall, ...] = ()
        if self.tool_mode == "auto" and self.tool_parser is not None:
            extracted = self.tool_parser.extract(content or "")
            content, calls = extracted.content, extracted.tool_calls
        elif self.tool_mode in ("required", "named"):
            calls = _forced_calls(self, content or "")
            if calls:
                content = None
        message: dict[str, Any] = {"role": self.role, "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [_tool_call(call) for call in calls]
        return message

    def streamer(self) -> ChatOutputStreamer:
        return ChatOutputStreamer(self)


class ChatOutputStreamer:
    """The deltas of one streamed choice; ``called_tools`` decides its ``finish_reason``."""

    def __init__(self, config: ChatOutputConfig) -> None:
        self.config = config
        self._reasoning = config.reasoning_parser.streamer() if config.reasoning_parser else None
        # constrained: undecided until the output has shown whether it opens a <think> block
        self._opening: Optional[str] = "" if config.constrained and self._reasoning is not None else None
        auto = config.tool_mode == "auto" and config.tool_parser is not None
        self._tools = config.tool_parser.streamer() if auto else None
        self._forced_text: list[str] = []  # required: the JSON array, parsed at the end
        self._named_id: Optional[str] = None
        self.called_tools = False

    def delta(self, text: str) -> dict[str, Any]:
        """The delta fields for newly generated ``text`` (empty when nothing can be said yet)."""
        if self._opening is not None:
            text = self._decide_opening(text, final=False)
        reasoning, content = self._reasoning.feed(text) if self._reasoning and text else ("", text)
        return self._shape(reasoning, content, final=False)

    def finish(self) -> dict[str, Any]:
        """Whatever was held back, at the end of the choice."""
        text = self._decide_opening("", final=True) if self._opening is not None else ""
        fed = self._reasoning.feed(text) if self._reasoning and text else ("", text)
        done = self._reasoning.finish() if self._reasoning else ("", "")
        return self._shape(fed[0] + done[0], fed[1] + done[1], final=True)

    def _decide_opening(self, text: str, final: bool) -> str:
        """Hold a constrained output back until it shows whether it opens <think>; then drop the reasoning parser
        if it does not. Returns the text to pass on now."""
        assert self._opening is not None
        held = self._opening + text
        start = held.lstrip()
        if not final and len(start) < len(THINK_START) and THINK_START.startswith(start):
            self._opening = held
            return ""
        if not start.startswith(THINK_START):
            self._reasoning = None
        self._opening = None
        return held

    def _shape(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        mode = self.config.tool_mode
        if self._tools is not None:
            parsed = self._tools.feed(content) if content else None
            parts = [p for p in (parsed, self._tools.finish() if final else None) if p is not None]
            text = "".join(p.content for p in parts)
            calls = [c for p in parts for c in p.tool_calls]
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [_tool_call_delta(c) for c in calls]
                self.called_tools = True
        elif mode == "named" and self.config.tool_name is not None:
            self._named_delta(content, delta)
        elif mode == "required":
            self._forced_text.append(content)
            if final:
                self._required_final(delta)
        elif content:
            delta["content"] = content
        return delta

    def _named_delta(self, content: str, delta: dict[str, Any]) -> None:
        # The output is the arguments object itself: stream it as the call's argument fragments.
        if not content:
            return
        fragment: dict[str, Any] = {"index": 0, "function": {"arguments": content}}
        if self._named_id is None:
            self._named_id = new_tool_call_id()
            fragment = {
                "index": 0,
                "id": self._named_id,
                "type": "function",
                "function": {"name": self.config.tool_name, "arguments": content},
            }
        delta["tool_calls"] = [fragment]
        self.called_tools = True

    def _required_final(self, delta: dict[str, Any]) -> None:
        text = "".join(self._forced_text)
        calls = _forced_calls(self.config, text)
        if calls:
            delta["tool_calls"] = [{"index": i, **_tool_call(call)} for i, call in enumerate(calls)]
            self.called_tools = True
        elif text:
            delta["content"] = text  # cut short (length): not a complete call, so the raw text


def _forced_calls(config: ChatOutputConfig, text: str) -> tuple[ToolCall, ...]:
    """The calls of a grammar-forced output, or none if it was cut short before it was complete JSON."""
    try:
        if config.tool_mode == "required":
            return tuple(parse_required_output(text))
        assert config.tool_name is not None
        return (named_tool_call(config.tool_name, text),)
    except ValueError:
        return ()


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": delta.index}
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
    if delta.name is not None:
        function["name"] = delta.name
    out["function"] = function
    return out
