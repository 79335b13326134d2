"""The API's ways of asking for structured output, reduced to one ``StructuredOutputsParams``.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` object and its
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields all mean the same
thing; a request may use one of them. Every error is a 400 naming the field it is about.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pagoda.entrypoints.openai.errors import OpenAIError, bad_request
from pagoda.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagoda.entrypoints.openai.defaults import ServerLimits
    from pagoda.structured_output.compiler import StructuredOutputCompiler

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_OUTPUTS_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def structured_outputs_of(body: Any) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The constraint a completions or chat request asks for, and the field it came from (for errors)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if body.response_format is not None:
        params = _from_response_format(body.response_format)
        if params is not None:
            field = "response_format.json_schema.schema" if params.json is not None else "response_format"
            found.append((field, params))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(body.structured_outputs)))
    for field, kind in _GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            found.append((field, _build(field, **{kind: value})))
    if len(found) > 1:
        names = ", ".join(name.split(".")[0] for name, _ in found)
        raise bad_request(
            f"give at most one structured output constraint; this request has {names}", found[1][0].split(".")[0]
        )
    return (found[0][1], found[0][0]) if found else (None, None)


def spec_chars(params: StructuredOutputsParams) -> int:
    """The size of a constraint's text (what compiling it costs grows with)."""
    if params.choice is not None:
        return sum(len(c) for c in params.choice)
    value = getattr(params, params.kind)
    return len(value) if isinstance(value, str) else 0


def _from_response_format(value: dict[str, Any]) -> Optional[StructuredOutputsParams]:
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}", "response_format"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("response_format", json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with a schema", "response_format.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name must be a string", "response_format.json_schema.name")
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows leaving it out: then any JSON object
        return _build("response_format", json_object=True)
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be an object", "response_format.json_schema.schema")
    return _build("response_format.json_schema.schema", json=schema)


def _from_structured_outputs(value: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise bad_request(
            f"structured_outputs has unsupported keys {unknown}; supported: {', '.join(_STRUCTURED_OUTPUTS_KEYS)}",
            "structured_outputs",
        )
    return _build("structured_outputs", **{k: v for k, v in value.items() if v is not None})


def _build(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except (TypeError, ValueError) as exc:
        message = str(exc).replace("structured_outputs", field, 1) if field != "structured_outputs" else str(exc)
        raise bad_request(message, field) from None


def configure_compiler(compiler: StructuredOutputCompiler, limits: ServerLimits) -> None:
    """Apply the server's flags (a ``ServerLimits``) to an engine's ``StructuredOutputCompiler``: the grammar
    cache's bounds and the number of abandoned compiles allowed."""
    compiler.configure(
        cache_size=limits.structured_output_cache_entries,
        cache_bytes=limits.structured_output_cache_bytes,
        max_abandoned=limits.max_abandoned_compiles,
    )


def compile_error(exc: ValueError, field: Optional[str]) -> OpenAIError:
    """A 400 for a constraint the engine could not compile, naming the request field it came from."""
    message = str(exc)
    if field and field != "structured_outputs":
        for kind in _STRUCTURED_OUTPUTS_KEYS:
            message = message.replace(f"structured_outputs.{kind}", field, 1)
    return bad_request(message, field)
