"""Tool-call parsers: turn a model's generated text into OpenAI ``tool_calls`` (``--tool-call-parser NAME``).

Each parser knows one model family's tool-call syntax:

- ``hermes`` (Hermes, Qwen2/2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks.
- ``llama3_json`` (Llama 3.1/3.2): an optional ``<|python_tag|>``, then ``{"name": ..., "parameters": {...}}``
  objects separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of calls (older tokenizers) or by ``name[ARGS]{...}``
  segments (v11+ tokenizers).

``base`` holds what they share (the result types, the ABCs, the JSON helpers and the generic streamers); each
format has its own module, and this package registers them in ``TOOL_CALL_PARSERS``.

Output that does not parse as tool calls is never an error: it is returned as plain content, because the model
is free to answer in prose and a half-formed call is better shown to the client than swallowed.

Streaming follows one rule: content text is emitted as soon as it is certain to be content under every possible
continuation, and everything from the start of the tool-call section on is held back until ``finish()``. Holding
the calls (rather than emitting each as its block closes) is what lets a later malformed block turn the whole
output back into content, exactly as the non-streaming ``extract()`` does; so for any split of the output into
chunks the streamed content and calls equal ``extract()``'s. The cost is small: a model ends its turn right after
its last call, so the calls arrive at most a few tokens later than they could.
"""

from __future__ import annotations

from pagoda.entrypoints.openai.output_parsing import make_parser
from pagoda.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
    new_mistral_tool_call_id,
    new_tool_call_id,
    parse_json,
    serialize_arguments,
)
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagoda.entrypoints.openai.tool_parsers.mistral import MistralToolParser

__all__ = [
    "TOOL_CALL_PARSERS",
    "DeltaMessage",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
    "new_mistral_tool_call_id",
    "new_tool_call_id",
    "parse_json",
    "serialize_arguments",
]

TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError listing the known names otherwise."""
    return make_parser(TOOL_CALL_PARSERS, name, "tool call parser")
