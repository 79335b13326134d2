"""JSON Schemas the served OpenAPI document gives request fields whose pydantic types say too little.

``protocol`` attaches them with ``WithJsonSchema``: validation itself is done by the field types and validators
there; these only state in the document what the server accepts.
"""

from __future__ import annotations

from typing import Any

from pagoda.sampling_params import MAX_LOGIT_BIAS

# The response_format types the server accepts: protocol validates against them, the schema below lists them.
SUPPORTED_RESPONSE_FORMATS = ("text", "json_object", "json_schema")

LOGIT_BIAS_SCHEMA = {
    "type": "object",
    "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
}
RESPONSE_FORMAT_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": list(SUPPORTED_RESPONSE_FORMATS)},
        "json_schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "schema": {"type": "object"},
                "strict": {"type": ["boolean", "null"]},
            },
        },
    },
    "required": ["type"],
}
STRUCTURED_OUTPUTS_SCHEMA = {
    "type": "object",
    "description": "exactly one of the properties",
    "properties": {
        "json": {"type": ["object", "string"]},
        "json_object": {"type": "boolean"},
        "regex": {"type": "string"},
        "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "grammar": {"type": "string", "description": "xgrammar EBNF"},
    },
}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
                "strict": {"type": ["boolean", "null"]},
            },
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            },
            "required": ["type", "function"],
        },
    ]
}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null, defaulting to null (an optional request field)."""
    return {"anyOf": [schema, {"type": "null"}], "default": None}
