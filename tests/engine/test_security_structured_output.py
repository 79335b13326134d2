"""Structured outputs under hostile input, against a real `pagoda serve` (issue 32, requirement 5).

Every hostile request gets a 4xx within 2 s, /health answers within 100 ms (p99) while it is handled, other
requests are served meanwhile, and repeating it grows no threads, file descriptors or memory:

* a constraint that compiles for seconds (xgrammar cannot be interrupted) is abandoned at the time limit: its
  thread no longer blocks other compiles, the same spec is refused at once afterwards, and while too many
  abandoned compiles still run new constraints get a 429 instead of more threads;
* regexes that backtracking engines take exponential time on are compiled to automata, never matched by ``re``;
* invalid schemas and tool parameters (``$ref`` loops, bad types, 10,000 levels deep, 10 MB) are 400s in the
  OpenAI error format, and the server keeps serving;
* the grammar cache is bounded in entries and in bytes, whatever the number of distinct schemas.
"""

from __future__ import annotations

import json
import os
import threading
import time
from itertools import count

import pytest
from security_helpers import HealthProbe, assert_no_growth, assert_openai_error, read_resources, repeat, settle
from server_helpers import Server, start_server

from pagoda.structured_output.params import StructuredOutputsParams

pytestmark = pytest.mark.slow  # starts a real server process

COMPILE_TIMEOUT = 1.0  # the server's --structured-output-compile-timeout
MAX_ABANDONED = 3  # its --max-abandoned-compiles (not the default 2, so the flag is seen to apply)
_salt = count()


@pytest.fixture(scope="module")
def server(tiny_chat_qwen3):
    server = start_server(
        str(tiny_chat_qwen3),
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--structured-output-compile-timeout",
        str(COMPILE_TIMEOUT),
        "--max-abandoned-compiles",
        str(MAX_ABANDONED),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield server
    server.stop()


def completion(server: Server, max_tokens: int = 1, **extra) -> tuple[int, dict, float]:
    """(status, body, seconds) of a one-prompt completion with the given extra fields."""
    start = time.monotonic()
    status, _, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": max_tokens, **extra})
    return status, body, time.monotonic() - start


def json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def slow_schema(properties: int = 1600) -> dict:
    """A ~60 KB schema xgrammar compiles in seconds (optional properties, quadratic: ~2 s for 1,200 on one core,
    ~3.5 s for 1,600, 54 s for 3,000), each call a new one (the salt)."""
    salt = next(_salt)
    props = {f"s{salt}p{i}": {"type": "string", "maxLength": 50} for i in range(properties)}
    return json_schema({"type": "object", "properties": props, "additionalProperties": False})


def fresh_regex() -> dict:
    return {"structured_outputs": {"regex": f"r{next(_salt)}[0-9]{{1,3}}"}}


def post_raw(server: Server, path: str, text: str) -> tuple[int, dict, dict]:
    return server.request("POST", path, raw=text.encode())


def wait_for_abandoned_compiles(server: Server, threads: int, within: float = 60.0) -> None:
    """Until the server is back to ``threads`` threads: abandoned compiles exit once their native call returns."""
    deadline = time.monotonic() + within
    while read_resources(server.process.pid).threads > threads:
        assert time.monotonic() < deadline, f"threads stay above {threads}"
        time.sleep(0.2)


# ---- regexes that backtrack exponentially ----------------------------------------------------------------

REDOS = ["(a+)+$", "(a|aa)+b", "^(([a-z])+.)+[A-Z]([a-z])+$", "(a|b)*a(a|b){20}", "(.*a){20}"]


@pytest.mark.parametrize("pattern", REDOS)
def test_catastrophic_regexes_compile_to_automata_and_hang_nothing(server, pattern):
    with HealthProbe(server.port) as probe:
        for extra in (
            {"structured_outputs": {"regex": pattern}},
            {"guided_regex": pattern},
            json_schema({"type": "string", "pattern": pattern}),
        ):
            status, body, seconds = completion(server, max_tokens=4, **extra)
            assert status == 200 and seconds < 2, (extra, body, seconds)
        time.sleep(0.1)  # answered in milliseconds: give the probe a few samples
    probe.assert_healthy()


# ---- invalid schemas and tool parameters -----------------------------------------------------------------


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_text(levels: int) -> str:
    """``nested(levels)`` as JSON text (json.dumps itself cannot go 10,000 levels deep)."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
INVALID_SCHEMAS = {
    "self $ref": {"$ref": "#"},
    "$ref loop": LOOP,
    "dangling $ref": {"$ref": "#/$defs/missing"},
    "bad type": {"type": ["string", 3]},
    "unknown type": {"type": "frobnicate"},
    "items not a schema": {"type": "array", "items": 5},
    "300 KB": {"enum": ["x" * 1000] * 300},
}
SCHEMA_TEXTS = {name: json.dumps(schema) for name, schema in INVALID_SCHEMAS.items()}
SCHEMA_TEXTS["10,000 levels"] = nested_text(10_000)


def tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("schema", SCHEMA_TEXTS.values(), ids=SCHEMA_TEXTS.keys())
def test_an_invalid_schema_is_a_400_in_the_openai_format(server, schema):
    response_format = '{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + schema + "}}"
    start = time.monotonic()
    status, _, body = post_raw(
        server, "/v1/completions", '{"prompt": "x", "max_tokens": 1, "response_format": ' + response_format + "}"
    )
    assert_openai_error(status, body, 400)
    assert time.monotonic() - start < 2
    chat = '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1'
    tools = '[{"type": "function", "function": {"name": "f", "parameters": ' + schema + "}}]"
    for tool_choice in ('"required"', '{"type": "function", "function": {"name": "f"}}'):
        status, _, body = post_raw(
            server, "/v1/chat/completions", f'{chat}, "tools": {tools}, "tool_choice": {tool_choice}}}'
        )
        assert_openai_error(status, body, 400)
    assert completion(server, max_tokens=2)[0] == 200


@pytest.mark.parametrize("parameters", [5, "object", ["type"]], ids=str)
def test_tool_parameters_that_are_not_an_object_schema_are_400s(server, parameters):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "tool_choice": "required"}
    status, _, body = server.request("POST", "/v1/chat/completions", {**chat, "tools": [tool(parameters)]})
    assert_openai_error(status, body, 400)


def test_a_schema_10000_levels_deep_in_a_string_is_a_400(server):
    status, body, _ = completion(server, guided_json=nested_text(10_000))  # the schema as JSON text
    assert_openai_error(status, body, 400)
    assert "nested more than" in body["error"]["message"]


def test_a_schema_that_is_not_an_object_or_10_mb_is_refused(server):
    status, body, _ = completion(server, response_format={"type": "json_schema", "json_schema": {"schema": "x"}})
    assert_openai_error(status, body, 400)
    huge = json_schema({"enum": ["x" * 1000] * 10_000})  # 10 MB: over --max-request-body-bytes
    status, body, seconds = completion(server, **huge)
    assert_openai_error(status, body, 413)
    assert seconds < 2
    assert completion(server, max_tokens=2)[0] == 200


# ---- the grammar cache --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler():
    from tiny_chat_model import EOS_TOKEN_IDS, VOCAB_SIZE, build_tiny_chat_tokenizer

    from pagoda.structured_output.compiler import StructuredOutputCompiler

    compiler = StructuredOutputCompiler(build_tiny_chat_tokenizer(), VOCAB_SIZE, EOS_TOKEN_IDS)
    yield compiler
    compiler.shutdown()


def test_a_schema_nested_beyond_the_limit_is_refused_before_any_recursion(compiler):
    with pytest.raises(ValueError, match="nested more than 128 levels"):
        StructuredOutputsParams(json=nested(100_000))  # deeper than json.dumps goes
    with pytest.raises(ValueError, match="nested more than 128 levels"):  # deep enough for jsonschema to recurse
        compiler.compile(StructuredOutputsParams(json=nested(100))).result(timeout=10)
    compiler.compile(StructuredOutputsParams(json=nested(60))).result(timeout=10)  # 121 levels of JSON: fine


def test_the_grammar_cache_is_bounded_in_entries_and_bytes(compiler):
    from pagoda.entrypoints.openai.defaults import ServerLimits
    from pagoda.entrypoints.openai.structured_request import configure_compiler

    compiler.configure(cache_size=256)
    futures = [compiler.compile(StructuredOutputsParams(regex=f"x{i}")) for i in range(10_000)]
    for future in futures:
        future.result(timeout=60)
    # A future's waiters wake before its done-callback moves it from the pending set (never evicted) to the bounded
    # finished ones: wait for the last callbacks before counting.
    deadline = time.monotonic() + 10
    while compiler.num_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compiler.cache_entries <= 256  # 10,000 distinct specs compiled, the most recent 256 kept
    # Grammars of ~0.2 MB each: the byte bound (the server's flag) holds however many there are.
    configure_compiler(compiler, ServerLimits(structured_output_cache_bytes=2 * 1024 * 1024))
    for i in range(100):
        compiler.compile(StructuredOutputsParams(regex=f"[a-z]{{{100 + i},{200 + i}}}")).result(timeout=60)
        assert compiler.cache_bytes <= 2 * 1024 * 1024
    assert 0 < compiler.cache_entries < 100


def test_an_abandoned_call_frees_its_worker_and_abandoned_calls_are_bounded():
    from pagoda.structured_output.pool import CompilePool

    pool = CompilePool(workers=1, max_abandoned=1)
    release = threading.Event()
    try:
        tids: list[int] = []
        stuck = pool.submit(lambda: tids.append(threading.get_native_id()) or release.wait())
        behind = pool.submit(lambda: "compiled")
        deadline = time.monotonic() + 5
        while not stuck.running():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pool.abandon(stuck, ValueError("too long"))
        with pytest.raises(ValueError, match="too long"):
            stuck.result(timeout=0)
        assert behind.result(timeout=5) == "compiled"  # a new worker took the stuck one's place
        assert pool.saturated and pool.num_abandoned == 1
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == 19  # it yields the CPU to everything else
        release.set()  # the native call returns: its thread exits, its result unused
        deadline = time.monotonic() + 5
        while pool.saturated:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not pool.abandon(behind, ValueError())  # finished: nothing to abandon
    finally:
        release.set()
        pool.shutdown(wait=5)


def test_1000_distinct_schemas_leave_no_threads_fds_or_memory_behind(server):
    def schema_request(i: int) -> int:
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        return completion(server, **json_schema(schema))[0]

    assert set(repeat(100, lambda i: schema_request(-1 - i), concurrency=8)) == {200}  # warm-up
    before = read_resources(server.process.pid)
    with HealthProbe(server.port) as probe:
        assert set(repeat(1000, schema_request, concurrency=8)) == {200}
    probe.assert_healthy()
    assert_no_growth(before, settle(server.process.pid, before))


# ---- compiles past the time limit -------------------------------------------------------------------------


def test_a_compile_past_the_limit_is_abandoned_and_holds_up_nothing(server):
    with HealthProbe(server.port) as probe:
        slow = slow_schema()
        status, body, seconds = completion(server, **slow)
        assert_openai_error(status, body, 400)
        assert seconds < 2 and "longer than" in body["error"]["message"], (seconds, body)
        # The abandoned compile still runs on its own thread; a new constraint compiles on another right away.
        status, body, seconds = completion(server, max_tokens=4, **fresh_regex())
        assert status == 200 and seconds < 2, (body, seconds)
        assert completion(server, max_tokens=4)[0] == 200
        # The same spec is refused at once, not compiled (nor waited for) again.
        status, body, seconds = completion(server, **slow)
        assert_openai_error(status, body, 400)
        assert "took too long" in body["error"]["message"] and seconds < COMPILE_TIMEOUT, (body, seconds)
    probe.assert_healthy()


def test_while_abandoned_compiles_run_new_constraints_get_429_and_threads_do_not_pile_up(server):
    cached = {"structured_outputs": {"regex": "cached[0-9]"}}
    assert completion(server, **cached)[0] == 200
    before = read_resources(server.process.pid)
    with HealthProbe(server.port) as probe:
        statuses, refusals = [], []
        for _ in range(6):
            status, body, seconds = completion(server, **slow_schema())
            assert status in (400, 429) and seconds < 2, (status, body, seconds)
            statuses.append(status)
            refusals += [body["error"]["message"]] if status == 429 else []
        # MAX_ABANDONED may run past the limit (the previous test's among them, maybe); then 429s saying why.
        assert statuses.count(400) <= MAX_ABANDONED and statuses[-3:] == [429] * 3, statuses
        assert all(f"(--max-abandoned-compiles {MAX_ABANDONED})" in message for message in refusals), refusals
        assert completion(server, **cached)[0] == 200  # cached constraints are still served
        assert completion(server, max_tokens=4)[0] == 200  # and so are plain requests
        during = read_resources(server.process.pid)
    probe.assert_healthy()
    assert during.threads <= before.threads + MAX_ABANDONED, (before, during)  # a replacement per abandoned
    wait_for_abandoned_compiles(server, before.threads)
    after = read_resources(server.process.pid)
    assert after.fds <= before.fds + 2, (before, after)
    assert completion(server, **fresh_regex())[0] == 200
