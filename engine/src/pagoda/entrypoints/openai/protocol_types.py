"""The value types of the OpenAI request models (:mod:`protocol`): JSON Schema integers, token ids, prompts and
stop strings, checked by hand where pydantic's union errors would name the union's members instead of the field."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import BeforeValidator, Field


def json_integer(value: object) -> object:
    """JSON Schema's integer: 5 and 5.0, never true or "5" (strict validation then rejects those)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer as JSON Schema (and so the served document) defines it.
Int = Annotated[int, BeforeValidator(json_integer)]
TokenId = Annotated[Int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptInput = Union[
    str,
    Annotated[list[str], Field(min_length=1)],
    TokenIds,
    Annotated[list[TokenIds], Field(min_length=1)],
]
Prompt = Union[str, list[int]]


def is_token_ids(value: object) -> bool:
    # bool is an int subclass, but true/false in a prompt is a client bug, not token ids 1/0.
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def check_prompt(value: object) -> PromptInput:
    """One string, a list of strings, token ids, or a list of token-id lists; never empty lists."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        value = [[json_integer(t) for t in p] if isinstance(p, list) else json_integer(p) for p in value]
    if not isinstance(value, list) or not value:
        raise ValueError("prompt must be a string, a non-empty list of strings, or (lists of) token ids")
    if all(isinstance(p, str) for p in value):
        return value
    if is_token_ids(value):
        return value
    if all(isinstance(p, list) for p in value):
        if all(p and is_token_ids(p) for p in value):
            return value
        raise ValueError("prompt token-id lists must be non-empty lists of non-negative integers")
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


def check_stop(value: object) -> Union[None, str, list[str]]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("stop must be a string or a list of strings")
