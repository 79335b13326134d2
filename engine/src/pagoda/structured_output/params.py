"""What a request constrains its output to: one of a JSON Schema, any JSON object, a regex, a fixed choice
of strings, or a grammar (EBNF) - vLLM's ``StructuredOutputsParams``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Nesting of a JSON Schema's JSON (objects and arrays): real schemas stay far below it, and deeper ones would
# overflow the recursion of json.dumps, jsonschema or xgrammar (a native stack overflow kills the process).
MAX_SCHEMA_DEPTH = 128


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one constraint. ``json`` takes a schema as a dict or JSON text and keeps it as compact JSON
    text, so equal schemas share one compiled grammar. A schema means what JSON Schema says (an object without
    ``additionalProperties: false`` may hold more properties); keywords the grammar cannot enforce are refused.
    """

    json: Union[None, str, dict[str, Any]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) is not None and getattr(self, kind) is not False]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)} (got {found}).")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be true or false.")
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_schema(self.json))
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string.")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) is not None and getattr(self, kind) is not False)

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the cache key)."""
        kind = self.kind
        return (kind, getattr(self, kind))

    @property
    def schema(self) -> Optional[dict[str, Any]]:
        """The JSON Schema as a dict (json kind only)."""
        return json.loads(self.json) if isinstance(self.json, str) else None


def _canonical_schema(schema: Union[str, dict[str, Any]]) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc.msg} at position {exc.pos}.") from None
        except RecursionError:
            raise ValueError(f"structured_outputs.json is nested more than {MAX_SCHEMA_DEPTH} levels deep.") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json must be a JSON Schema object.")
    # Not sorted: the order of "properties" is the order the output's keys come in. This runs on the event loop:
    # json.dumps is C, while walking a schema in Python is not (2M nested lists: seconds), so the depth limit is
    # checked where the schema compiles, and here only what json.dumps itself cannot take is refused.
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise ValueError(f"structured_outputs.json is nested more than {MAX_SCHEMA_DEPTH} levels deep.") from None


def depth_exceeds(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest deeper than ``limit`` (iterative: the value may be 10,000 levels deep)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
