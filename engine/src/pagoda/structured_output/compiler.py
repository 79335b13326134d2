"""Compiling structured-output specs into xgrammar grammars, off the engine thread and cached by spec.

xgrammar compiles in native code without holding the GIL (measured: the engine thread keeps running with
sub-millisecond gaps). Compiles run on a small pool of threads (:class:`~pagoda.structured_output.pool.CompilePool`):
one that runs past its caller's time limit is abandoned (see :meth:`StructuredOutputCompiler.forget`), so a
pathological spec delays nobody else, and while too many abandoned compiles are still burning CPU new specs are
refused (:class:`CompileQueueFull`). Results are cached by the spec's key, bounded in entries and bytes: the
second request with a schema gets an already-finished future. Failed specs are cached too (the same spec fails
the same way) and reported as ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Optional

from pagoda.structured_output.params import MAX_SCHEMA_DEPTH, StructuredOutputsParams, depth_exceeds
from pagoda.structured_output.pool import CompilePool, GrammarCache

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 512  # compiled specs kept (a compiled JSON grammar is tens to hundreds of KiB)
# Bytes of compiled grammars kept: one 10,000-value enum alone compiles to ~26 MB (measured, a 457-token vocab).
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
DEFAULT_COMPILE_WORKERS = 2  # compiles at once: a slow one leaves the other worker to the rest
DEFAULT_MAX_ABANDONED = 2  # compiles past their time limit still running; beyond it new specs are refused
DEFAULT_MAX_WHITESPACE = 0  # longest whitespace run between JSON tokens; 0: compact JSON (", " and ": ")


class StructuredOutputCompiler:
    """Owns the xgrammar tokenizer info and compiler for one model's vocabulary.

    ``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's: ids without a
    token are never allowed. ``stop_token_ids`` end a finished grammar (the model's EOS ids).
    ``max_whitespace`` bounds runs of whitespace in JSON outputs (0: compact JSON, no free whitespace), so a
    model cannot loop on whitespace until max_tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        max_whitespace: int = DEFAULT_MAX_WHITESPACE,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        workers: int = DEFAULT_COMPILE_WORKERS,
        max_abandoned: int = DEFAULT_MAX_ABANDONED,
    ) -> None:
        import xgrammar as xgr  # 2 s to import: only engines that serve structured outputs pay it

        if max_whitespace < 0:
            raise ValueError("max_whitespace must be >= 0")
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.max_whitespace = max_whitespace
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
        )
        # xgrammar's own cache is off: ours caches futures, so concurrent requests for one spec compile once. One
        # compile may use half the cores (8 at most): the other half stays with the engine's step.
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._cache = GrammarCache(cache_size, cache_bytes)
        self._pool = CompilePool(workers, max_abandoned)

    def configure(
        self, cache_size: Optional[int] = None, cache_bytes: Optional[int] = None, max_abandoned: Optional[int] = None
    ) -> None:
        """Change the cache bounds or the abandoned-compile limit (the server's flags); None keeps a value."""
        if max_abandoned is not None and max_abandoned < 1:
            raise ValueError("max_abandoned must be >= 1")
        cache = self._cache
        cache.set_bounds(cache_size or cache.max_entries, cache_bytes or cache.max_bytes)
        if max_abandoned is not None:
            self._pool.max_abandoned = max_abandoned

    def compile(self, params: StructuredOutputsParams, max_pending: Optional[int] = None) -> Future:
        """A future of the compiled grammar; its exception is a ValueError naming what is wrong.

        A spec that is not cached yet is refused (:class:`CompileQueueFull`) while too many abandoned compiles
        still run, and with ``max_pending`` while that many compiles are queued or running: a flood of slow specs
        must not make every later request wait behind it."""
        key = params.key
        with self._cache.lock:
            future = self._cache.get(key)
            if future is not None:
                return future
            if self._pool.saturated:
                raise CompileQueueFull(
                    f"{self._pool.num_abandoned} output constraints that ran past their time limit are still compiling "
                    f"(--max-abandoned-compiles {self._pool.max_abandoned})"
                )
            if max_pending is not None and self.num_pending >= max_pending:
                raise CompileQueueFull(f"{self.num_pending} output constraints are compiling")
            future = self._pool.submit(self._compile, params)
            self._cache.put(key, future)
        return future

    @property
    def num_pending(self) -> int:
        """Compiles queued or running (abandoned ones not included)."""
        return self._cache.num_pending

    @property
    def num_abandoned(self) -> int:
        """Compiles abandoned by :meth:`forget` whose native call is still running."""
        return self._pool.num_abandoned

    @property
    def cache_bytes(self) -> int:
        """Bytes of the compiled grammars in the cache."""
        return self._cache.num_bytes

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    def forget(self, params: StructuredOutputsParams) -> bool:
        """Give up on a spec whose caller ran out of time: a queued compile is cancelled and dropped from the
        cache; a running one is abandoned, its future failing now with a ValueError that stays cached (the same
        spec is refused at once next time, not compiled again). False if it had already finished."""
        with self._cache.lock:
            future = self._cache.get(params.key)
            if future is None or future.done():
                return False
            error = ValueError(
                f"structured_outputs.{params.kind}: compiling this constraint took too long; simplify it"
            )
            if not self._pool.abandon(future, error):
                return False
            if future.cancelled():
                self._cache.pop(params.key)
            else:
                logger.warning("abandoned a %s compile that ran past its time limit", params.kind)
            return True

    def shutdown(self) -> None:
        self._pool.shutdown()

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        try:
            if kind == "json":
                return self._compile_json(params)
            if kind == "json_object":  # any object, under the same whitespace rule as a schema
                return self._compile_schema('{"type": "object"}')
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(params.choice))
            return self._compiler.compile_grammar(params.grammar)
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError (and subclasses) for what it cannot parse
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {_first_line(exc)}") from None

    def _compile_json(self, params: StructuredOutputsParams) -> Any:
        schema = params.schema
        if depth_exceeds(schema, MAX_SCHEMA_DEPTH):  # before jsonschema's and xgrammar's recursion
            raise ValueError(f"structured_outputs.json is nested more than {MAX_SCHEMA_DEPTH} levels deep.")
        check_json_schema(schema, "structured_outputs.json")
        check_enforceable(schema, "structured_outputs.json")
        return self._compile_schema(params.json)

    def _compile_schema(self, schema: str) -> Any:
        # strict_mode off: JSON Schema's own meaning. On, xgrammar reads a missing "items" or
        # "additionalProperties" as "none allowed", so {"type": "array"} could only ever be [].
        grammar = self._xgr.Grammar.from_json_schema(
            schema,
            any_whitespace=self.max_whitespace > 0,
            max_whitespace_cnt=self.max_whitespace or None,
            strict_mode=False,
        )
        return self._compiler.compile_grammar(valid_json_strings(str(grammar)))


class CompileQueueFull(RuntimeError):
    """Too many output constraints are compiling; try again later."""


def check_json_schema(schema: Any, where: str) -> None:
    """ValueError (starting with ``where``) unless ``schema`` is a valid JSON Schema of its declared draft."""
    from jsonschema import exceptions, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as exc:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        raise ValueError(f"{where}{path} is not a valid JSON Schema: {exc.message}") from None


# Characters of a JSON string, as xgrammar 0.2.9 writes them: for strings with a length bound, "not a quote,
# backslash, CR or LF", which lets the control characters that JSON forbids unescaped through (json.loads refuses
# the output); for the others, "not a quote, backslash or control character". Neither excludes the surrogate
# code points U+D800-U+DFFF, whose UTF-8 encodings are invalid and decode to U+FFFD (observed: a string of
# maxLength 8 came out as 10 characters). Every one becomes the class JSON actually allows.
_STRING_CHAR_CLASSES = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]", r"[^\"\\\0-\x1f]")
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\ud800-\udfff]"


def valid_json_strings(ebnf: str) -> str:
    """xgrammar's JSON grammar with string characters restricted to what JSON and UTF-8 allow."""
    for char_class in _STRING_CHAR_CLASSES:
        ebnf = ebnf.replace(char_class, _JSON_STRING_CHAR)
    return ebnf


# Keywords xgrammar 0.2.9 accepts but does not enforce (measured: an instance that breaks them is generated):
# refused, since an output that looks constrained but is not is worse than a clear 400. oneOf is enforced as
# anyOf (its branches are usually disjoint, e.g. pydantic's discriminated unions); allOf only with one entry.
UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")


def check_enforceable(schema: Any, where: str) -> None:
    """ValueError naming the keyword and where it is, for a schema that uses what the grammar cannot enforce."""
    stack: list[tuple[Any, str]] = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for keyword in UNENFORCED_KEYWORDS:
            if keyword in node:
                raise ValueError(f"{path}: the keyword {keyword!r} is not supported (outputs could not be held to it)")
        if node.get("uniqueItems") is True:
            raise ValueError(f"{path}: uniqueItems is not supported (outputs could not be held to it)")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise ValueError(f"{path}: allOf with more than one schema is not supported; merge them into one")
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((value, f"{path}.{key}.{name}") for name, value in node[key].items())
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((value, f"{path}.{key}[{i}]") for i, value in enumerate(node[key]))
        for key in _SCHEMA_VALUES:
            stack.append((node.get(key), f"{path}.{key}"))


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar prefixes its messages with a time and its C++ source location: not for clients.
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _NATIVE_PREFIX.sub("", text.splitlines()[0])[:500]
