"""The ``tools`` and ``tool_choice`` fields of the chat API: validation, and the JSON Schemas that force calls.

``tool_choice`` resolves to one of four modes:

- ``none``: the model answers in prose; the server does not show the tools to the chat template, so a model
  is not invited to write calls that would come back as plain text.
- ``auto``: the model decides; a tool-call parser finds the calls in its output.
- ``required``: the output is constrained to ``required_tool_calls_schema`` (a JSON array of calls) and read back
  with ``parse_required_output``.
- ``named``: the output is constrained to that tool's parameters schema and wrapped with ``named_tool_call``.

Errors are ``ValueError`` whose message starts with the path of the offending field (``tools[1].function.name:
...``), ready to become a 400 response.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Optional, Union

import jsonschema.validators
from jsonschema.exceptions import SchemaError

from pagoda.entrypoints.openai.tool_parsers import ToolCall, new_tool_call_id, parse_json, serialize_arguments

__all__ = [
    "TOOL_CHOICE_MODES",
    "named_tool_call",
    "named_tool_schema",
    "parse_required_output",
    "required_tool_calls_schema",
    "resolve_tool_choice",
    "validate_tools",
]

TOOL_CHOICE_MODES = ("none", "auto", "required", "named")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Keywords whose values are data, not subschemas: a "$ref" key inside them must be left alone.
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})


def _format_path(base: str, parts: Any) -> str:
    """``base`` extended by the keys/indices of a jsonschema error path: ``a.b[0].c``."""
    path = base
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _check_schema(schema: Any, path: str) -> None:
    """ValueError at ``path`` unless ``schema`` is a valid JSON Schema under the dialect it declares."""
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: must be a JSON Schema object, got {type(schema).__name__}")
    if not isinstance(schema.get("$schema", ""), str):
        raise ValueError(f"{path}.$schema: must be a string")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"{_format_path(path, exc.absolute_path)}: {exc.message}") from None
    except RecursionError:
        raise ValueError(f"{path}: schema nested too deeply") from None


def _optional(function: dict[str, Any], key: str, kind: type, path: str) -> Any:
    """``function[key]`` if present and not None, checked to be a ``kind``; None otherwise."""
    value = function.get(key)
    if value is not None and not isinstance(value, kind):
        raise ValueError(f"{path}.{key}: must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _validate_function(function: Any, path: str) -> dict[str, Any]:
    """The normalised ``function`` object of one tool; ValueError naming the field that is wrong."""
    if not isinstance(function, dict):
        raise ValueError(f"{path}: must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ValueError(f"{path}.name: must be 1-64 characters of letters, digits, '_' or '-', got {name!r}")
    normalised: dict[str, Any] = {"name": name}
    description = _optional(function, "description", str, path)
    if description is not None:
        normalised["description"] = description
    parameters = function.get("parameters")
    if parameters is None:
        parameters = copy.deepcopy(_DEFAULT_PARAMETERS)
    _check_schema(parameters, f"{path}.parameters")
    normalised["parameters"] = parameters
    strict = _optional(function, "strict", bool, path)
    if strict is not None:
        normalised["strict"] = strict
    return normalised


def validate_tools(tools: list[dict]) -> list[dict]:
    """Check a request's ``tools`` and return them normalised.

    Each tool becomes ``{"type": "function", "function": {"name", "description"?, "parameters", "strict"?}}``:
    ``parameters`` defaults to an object schema without properties, None-valued optional fields are dropped, and
    unknown fields are left out. ValueError (message starting with the field's path) for anything malformed,
    including a ``parameters`` that is not a valid JSON Schema and names used twice.
    """
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be an array, got {type(tools).__name__}")
    normalised: list[dict] = []
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        path = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{path}: must be an object")
        if tool.get("type") != "function":
            raise ValueError(f"{path}.type: must be 'function', got {tool.get('type')!r}")
        function = _validate_function(tool.get("function"), f"{path}.function")
        if function["name"] in seen:
            raise ValueError(f"{path}.function.name: duplicate tool name {function['name']!r}")
        seen.add(function["name"])
        normalised.append({"type": "function", "function": function})
    return normalised


def _tool_names(tools: Optional[list[dict]]) -> list[str]:
    return [tool["function"]["name"] for tool in tools or ()]


def resolve_tool_choice(tool_choice: Union[None, str, dict], tools: Optional[list[dict]]) -> tuple[str, Optional[str]]:
    """(mode, tool name) for a request's ``tool_choice`` and its (validated) ``tools``.

    ``mode`` is one of ``TOOL_CHOICE_MODES``; the name is set only for ``named``. Without ``tool_choice`` the mode
    is ``auto`` when there are tools and ``none`` otherwise. ValueError ("tool_choice: ...") for unknown values,
    for a function that is not among the tools, and for any mode but ``none`` without tools.
    """
    names = _tool_names(tools)
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if tool_choice == "none":
        return "none", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise ValueError(
                f"tool_choice: unknown value {tool_choice!r}; expected 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}'
            )
        if not names:
            raise ValueError(f"tool_choice: {tool_choice!r} needs tools, but the request has none")
        return tool_choice, None
    return "named", _named_choice(tool_choice, names)


def _named_choice(tool_choice: Any, names: list[str]) -> str:
    """The function name of a ``{"type": "function", "function": {"name": X}}`` choice, X among ``names``."""
    if not isinstance(tool_choice, dict):
        raise ValueError(f"tool_choice: must be a string or an object, got {type(tool_choice).__name__}")
    if tool_choice.get("type") != "function":
        raise ValueError(f"tool_choice.type: must be 'function', got {tool_choice.get('type')!r}")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice.function.name: must be a string")
    if not names:
        raise ValueError(f"tool_choice: names function {name!r}, but the request has no tools")
    if name not in names:
        raise ValueError(f"tool_choice.function.name: {name!r} is not among the tools ({', '.join(names)})")
    return name


def _rebase_refs(schema: Any, pointer: str) -> Any:
    """A copy of ``schema`` whose local ``$ref``s (``#...``) point to the same place once it sits at ``pointer``.

    Tool schemas refer to their own ``$defs`` as ``#/$defs/X``; embedded in a larger schema, ``#`` would mean the
    larger schema's root. A schema with its own ``$id`` is left as it is: its refs resolve against that ``$id``.
    """
    if isinstance(schema, list):
        return [_rebase_refs(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = copy.deepcopy(value)
        else:
            rebased[key] = _rebase_refs(value, pointer)
    return rebased


def _embedded_parameters(tool: dict, pointer: str) -> dict[str, Any]:
    parameters = tool["function"].get("parameters", _DEFAULT_PARAMETERS)
    if "$id" in parameters:
        return copy.deepcopy(parameters)
    return _rebase_refs(parameters, pointer)


def required_tool_calls_schema(tools: list[dict], parallel_tool_calls: bool) -> dict:
    """JSON Schema of the output under ``tool_choice="required"``: a non-empty array of calls.

    Each item is ``{"name": <a tool's name>, "parameters": <that tool's arguments>}`` (an ``anyOf`` over the
    tools); ``parallel_tool_calls=False`` allows exactly one item. ``tools`` must be validated first.
    """
    if not tools:
        raise ValueError("tool_choice: 'required' needs tools, but the request has none")
    variants = []
    for index, tool in enumerate(tools):
        pointer = f"/items/anyOf/{index}/properties/parameters"
        variants.append(
            {
                "type": "object",
                "properties": {
                    # enum rather than const: every grammar backend supports it.
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": _embedded_parameters(tool, pointer),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def named_tool_schema(tools: list[dict], name: str) -> dict:
    """The parameters schema of tool ``name`` (a copy), which the output must match under a named tool_choice."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return copy.deepcopy(tool["function"].get("parameters", _DEFAULT_PARAMETERS))
    raise ValueError(f"tool_choice.function.name: {name!r} is not among the tools")


def parse_required_output(text: str) -> tuple[ToolCall, ...]:
    """The calls in output generated under ``required_tool_calls_schema``; ValueError if it is not such an array.

    The schema is enforced while generating, but the output can still be cut short by the length limit, so the
    shape is checked again here.
    """
    try:
        calls = parse_json(text)
    except ValueError as exc:
        raise ValueError(f"tool calls output is not valid JSON: {exc}") from None
    if not isinstance(calls, list) or not calls:
        raise ValueError("tool calls output must be a non-empty JSON array")
    parsed = []
    for index, call in enumerate(calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool calls output[{index}]: must be an object")
        name, parameters = call.get("name"), call.get("parameters")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool calls output[{index}].name: must be a non-empty string")
        if not isinstance(parameters, dict):
            raise ValueError(f"tool calls output[{index}].parameters: must be an object")
        parsed.append(ToolCall(new_tool_call_id(), name, serialize_arguments(parameters)))
    return tuple(parsed)


def named_tool_call(name: str, text: str) -> ToolCall:
    """The call to ``name`` whose arguments the model generated as ``text``; ValueError unless it is a JSON object."""
    try:
        arguments = parse_json(text)
    except ValueError as exc:
        raise ValueError(f"arguments of {name!r} are not valid JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(new_tool_call_id(), name, serialize_arguments(arguments))
