"""The request side of ``POST /v1/responses`` (OpenAI's Responses API): the request model, and its ``input``,
``tools``, ``tool_choice`` and ``text.format`` fields in the shapes the chat machinery takes.

The sampling fields are the chat endpoint's (``temperature``, ``top_p``, vLLM's ``top_k``, ``seed``, ``stop``,
``structured_outputs`` ...); ``max_output_tokens`` replaces ``max_tokens``. ``input`` items become chat messages:
``message`` items (``input_text`` / ``output_text`` parts), ``function_call`` items (an assistant turn's tool
calls), ``function_call_output`` items (tool messages) and ``reasoning`` items (the next assistant turn's
reasoning). Every error is a ValueError or an ``OpenAIError`` naming the field, a 400.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationInfo, field_validator

from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import RESERVED_TEMPLATE_KWARGS, Int, _SamplingRequest
from pagoda.entrypoints.openai.tool_choice import resolve_tool_choice, validate_tools
from pagoda.structured_output.params import StructuredOutputsParams

# The built-in tools of OpenAI's Responses API: run by OpenAI's platform, never by this server.
BUILT_IN_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer_use",
        "computer_use_preview",
        "code_interpreter",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "custom",
    }
)
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesRequest(_SamplingRequest):
    """``POST /v1/responses``: stateless ``input`` plus ``instructions``, or a continuation of a stored response."""

    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Int] = Field(default=None, ge=1)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[None, str, dict[str, Any]] = None
    parallel_tool_calls: bool = True
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None  # accepted; the model's template decides whether it reasons
    store: bool = True
    previous_response_id: Optional[str] = None
    background: bool = False
    metadata: Optional[dict[str, str]] = None
    include: Optional[list[str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @field_validator("n")
    @classmethod
    def _one_output(cls, value: int) -> int:
        if value != 1:
            raise ValueError("a response has one output: n must be 1")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format_instead(cls, value: Optional[dict[str, Any]]) -> None:
        if value is not None:
            raise ValueError("the Responses API takes text.format, not response_format")
        return None

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported: send the request without background")
        return value

    @field_validator("stream_options")
    @classmethod
    def _no_stream_options(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise ValueError("the Responses API has no stream_options: a streamed response always ends with usage")
        return None

    @field_validator("prompt_logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, value: Optional[int]) -> None:
        if value is not None:
            raise ValueError("prompt_logprobs are not available in the Responses API")
        return None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        reserved = sorted(set(value or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}: the server sets those itself")
        return value

    def _output_fields(self, default_max_tokens: Optional[int]) -> tuple[Optional[int], Optional[int], dict[str, Any]]:
        max_tokens = self.max_output_tokens if self.max_output_tokens is not None else default_max_tokens
        return max_tokens, None, {}


# ---- input ------------------------------------------------------------------------------------------------


def input_messages(value: Union[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input``; ValueError whose message starts with the item's path."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    reasoning: Optional[str] = None  # a reasoning item's text, for the assistant turn that follows it
    for index, item in enumerate(value):
        path = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, path)
        elif kind == "function_call":
            message = _function_call(item, path)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).extend(message["tool_calls"])  # parallel calls: one turn
                continue
        elif kind == "function_call_output":
            message = _function_call_output(item, path)
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, path)
            continue
        else:
            raise ValueError(f"{path}.type: unsupported input item type {kind!r}")
        if reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"] = reasoning
            reasoning = None
        messages.append(message)
    return messages


def _string(item: dict[str, Any], key: str, path: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{path}.{key}: must be a string")
    return value


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ValueError(f"{path}.role: must be one of {', '.join(_ROLES)}, got {role!r}")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{path}.content[{number}].type: only text parts are supported, got {kind!r}")
            texts.append(_string(part, "text", f"{path}.content[{number}]"))
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"{path}.content: must be a string or a list of input_text parts")
    return {"role": _ROLES[role], "content": content}


def _function_call(item: dict[str, Any], path: str) -> dict[str, Any]:
    call = {"id": _string(item, "call_id", path), "type": "function"}
    call["function"] = {"name": _string(item, "name", path), "arguments": _string(item, "arguments", path)}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _function_call_output(item: dict[str, Any], path: str) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):  # output parts: their text
        output = "".join(p.get("text", "") for p in output if isinstance(p, dict) and isinstance(p.get("text"), str))
    if not isinstance(output, str):
        raise ValueError(f"{path}.output: must be a string")
    return {"role": "tool", "tool_call_id": _string(item, "call_id", path), "content": output}


def _reasoning_text(item: dict[str, Any], path: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise ValueError(f"{path}.content: must be a list of reasoning_text parts")
    return "".join(p["text"] for p in parts)


# ---- tools, tool_choice, text.format ----------------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses API's flat function tools (``{"type": "function", "name", ...}``) validated, in the chat
    shape; a 400 naming a built-in tool's type (this server runs none)."""
    nested = []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            what = f"built-in tool {kind!r} is not supported" if kind in BUILT_IN_TOOLS else f"unknown type {kind!r}"
            raise bad_request(f"tools[{index}].type: {what}; this server runs function tools only", "tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        nested.append({"type": "function", "function": function})
    try:
        return validate_tools(nested)
    except ValueError as exc:
        raise bad_request(str(exc).replace("].function.", "].", 1), "tools") from None


def tool_choice_mode(
    tool_choice: Union[None, str, dict[str, Any]], tools: Optional[list[dict[str, Any]]]
) -> tuple[str, Optional[str]]:
    """(mode, forced tool name) of a Responses ``tool_choice`` (``{"type": "function", "name": X}`` names one)."""
    if isinstance(tool_choice, dict):
        kind = tool_choice.get("type")
        if kind != "function":
            raise bad_request(f"tool_choice.type: {kind!r} is not supported; use 'function' with a name", "tool_choice")
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    try:
        return resolve_tool_choice(tool_choice, tools)
    except ValueError as exc:
        raise bad_request(str(exc).replace("tool_choice.function.name", "tool_choice.name"), "tool_choice") from None


def text_format_spec(text: Optional[dict[str, Any]]) -> Optional[StructuredOutputsParams]:
    """The constraint of ``text.format``: ``json_schema`` (its ``schema``), ``json_object``, or none for ``text``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format: must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(
            f"text.format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text.format.type"
        )
    schema = fmt.get("schema")
    if schema is None:
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise bad_request("text.format.schema: must be a JSON Schema object", "text.format.schema")
    try:
        return StructuredOutputsParams(json=schema)
    except (TypeError, ValueError) as exc:
        raise bad_request(
            str(exc).replace("structured_outputs.json", "text.format.schema"), "text.format.schema"
        ) from None
