"""xgrammar against llguidance on this machine: the numbers behind the structured-output backend choice.

For the Qwen3-shaped 151,936-token byte-level BPE of ``structured_outputs.py``: tokenizer set-up, compiling a nested schema, the time to fill 32 rows of a token
bitmask in the middle of a JSON object (the per-step cost), and which JSON Schema features each one compiles
(a refusal is a clear error). xgrammar is driven as the engine drives it (JSON Schema semantics, and Pagoda's
refusal of the keywords xgrammar accepts without enforcing). llguidance is not a dependency: ``pip install
llguidance`` first.

    python benchmarks/grammar_backends.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, log  # noqa: E402
from pagoda.structured_output.compiler import check_enforceable, valid_json_strings  # noqa: E402
from structured_outputs import REPO_ROOT, ensure_qwen3_bpe_checkpoint, nested_schema  # noqa: E402

FEATURES: dict[str, dict[str, Any]] = {
    "enum / const": {"type": "object", "properties": {"a": {"enum": [1, "x"]}, "b": {"const": 3}}},
    "integer bounds": {"type": "integer", "minimum": -3, "exclusiveMaximum": 50},
    "number bounds": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "string length": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"},
    "format: email": {"type": "string", "format": "email"},
    "format: date-time": {"type": "string", "format": "date-time"},
    "array min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "$ref / $defs": {"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
        "$ref": "#/$defs/node",
    },
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "min/maxProperties": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    "if / then": {"if": {"type": "integer"}, "then": {"minimum": 0}},
    "not": {"not": {"type": "string"}},
}
JSON_PREFIX = '{"order_bench": "A-17", "customer": {"name": "Ada"}, "items": [{"sku": "ABC-1234", "quantity": 3, "pri'


def timed(fn: Callable[[], Any], repeats: int = 5) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def xgrammar_rows(tokenizer: Any, vocab: int, eos: list[int], prefix_ids: list[int]) -> dict[str, Any]:
    import xgrammar as xgr

    setup, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos), 1)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_like_the_engine(schema: dict[str, Any]) -> Any:  # see structured_output/compiler.py
        check_enforceable(schema, "schema")
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False)
        return compiler.compile_grammar(valid_json_strings(str(grammar)))

    compile_s, grammar = timed(lambda: compile_like_the_engine(nested_schema("bench")))
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(32)]
    for matcher in matchers:
        assert all(matcher.accept_token(t) for t in prefix_ids), "the prefix must be valid under the schema"
    bitmask = xgr.allocate_token_bitmask(32, vocab)
    batch = xgr.BatchGrammarMatcher()
    fill_s, _ = timed(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask, list(range(32))), 20)
    coverage = {}
    for name, feature in FEATURES.items():
        try:
            compile_like_the_engine(feature)
            coverage[name] = "yes"
        except Exception as exc:  # noqa: BLE001 - any refusal counts
            coverage[name] = f"no ({str(exc).splitlines()[0][-60:]})"
    return {"setup": setup, "compile": compile_s, "fill": fill_s, "coverage": coverage}


def llguidance_rows(tokenizer: Any, vocab: int, prefix_ids: list[int]) -> Optional[dict[str, Any]]:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lltorch
    except ImportError:
        return None
    setup, lltok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), 1)

    def matcher_for(schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        return llguidance.LLMatcher(lltok, grammar, log_level=0)

    compile_s, first = timed(lambda: matcher_for(nested_schema("bench")))
    assert not first.is_error(), first.get_error()
    matchers = [matcher_for(nested_schema("bench")) for _ in range(32)]
    for matcher in matchers:
        assert matcher.consume_tokens(prefix_ids), matcher.get_error()
    bitmask = lltorch.allocate_token_bitmask(32, vocab)
    executor = llguidance.LLExecutor()
    pairs = [(m, i) for i, m in enumerate(matchers)]
    fill_s, _ = timed(lambda: lltorch.fill_next_token_bitmask_par(executor, pairs, bitmask), 20)
    coverage = {}
    for name, feature in FEATURES.items():
        matcher = matcher_for(feature)
        coverage[name] = "yes" if not matcher.is_error() else f"no ({matcher.get_error()[-60:]})"
    return {"setup": setup, "compile": compile_s, "fill": fill_s, "coverage": coverage}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    from transformers import AutoTokenizer

    path, vocab, eos = ensure_qwen3_bpe_checkpoint(REPO_ROOT / ".bench"), 151936, [2]
    tokenizer = AutoTokenizer.from_pretrained(path)
    prefix_ids = tokenizer.encode(JSON_PREFIX, add_special_tokens=False)
    log(f"tokenizer: {len(tokenizer)} tokens; JSON prefix of {len(prefix_ids)} tokens")
    results = {"xgrammar": xgrammar_rows(tokenizer, vocab, eos, prefix_ids)}
    llg = llguidance_rows(tokenizer, vocab, prefix_ids)
    if llg is not None:
        results["llguidance"] = llg
    names = list(results)
    rows = [
        ("tokenizer set-up (ms)", *(f"{results[n]['setup'] * 1e3:.1f}" for n in names)),
        ("compile nested schema (ms)", *(f"{results[n]['compile'] * 1e3:.1f}" for n in names)),
        ("fill 32 rows mid-object (ms)", *(f"{results[n]['fill'] * 1e3:.3f}" for n in names)),
        ("", *("" for _ in names)),
    ]
    rows += [(f"schema: {f}", *(results[n]["coverage"][f] for n in names)) for f in FEATURES]
    print(format_table(("", *names), rows))


if __name__ == "__main__":
    main()
