"""Property-based attacks on a real `pagoda serve`: random completion and chat bodies (hypothesis), and the
server against its own OpenAPI document (schemathesis). Whatever arrives, the answer is never a 5xx, and
after every example the engine is alive and a normal request still succeeds."""

import json
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import CHAT_TEMPLATE, Server, start_server

pytestmark = pytest.mark.slow  # a real server process, hundreds of requests

VOCAB = 512
MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def server():
    # Small limits keep each example cheap; the limits themselves are part of what is attacked.
    server = start_server(
        "--chat-template", CHAT_TEMPLATE, "--max-model-len", str(MAX_MODEL_LEN), "--max-n", "4", "--max-num-seqs", "16"
    )
    yield server
    server.stop()


# ---- bodies: a valid request, then up to three fields replaced by anything at all ----------------------

words = st.text(max_size=40)  # hypothesis leaves out lone surrogates here; the hostile values add them
hostile_texts = st.sampled_from(["abc\ud800", "\udfff", "\x00", "\u202e\ufeff", "", "a" * 3000, "</s><s>"])
numbers = st.one_of(
    st.integers(min_value=-5, max_value=300),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -1, 0.5, 2**63, -(2**63) - 1, 2**64, 1e39, 1e-300, 1e308, -0.0]),
)
anything = st.one_of(
    numbers,
    st.none(),
    st.booleans(),
    words,
    hostile_texts,
    st.lists(st.one_of(st.integers(-2, VOCAB + 2), words), max_size=4),
    st.dictionaries(words, st.one_of(st.integers(), words), max_size=2),
)
token_ids = st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=12)

VALID_FIELDS = {
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=VOCAB),
    "min_p": st.floats(min_value=0, max_value=1),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "seed": st.integers(min_value=-(2**40), max_value=2**40),
    "n": st.integers(min_value=1, max_value=3),
    "max_tokens": st.integers(min_value=1, max_value=12),
    "min_tokens": st.integers(min_value=0, max_value=2),
    "stop": st.one_of(words.filter(bool), st.lists(words.filter(bool), max_size=3)),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "model": st.just("stories260K"),
}
COMPLETION_FIELDS = {
    **VALID_FIELDS,
    "echo": st.booleans(),
    "logprobs": st.integers(min_value=0, max_value=5),
    "prompt": st.one_of(words.filter(bool), st.lists(words.filter(bool), min_size=1, max_size=3), token_ids),
}
CHAT_FIELDS = {
    **VALID_FIELDS,
    "logprobs": st.booleans(),
    # (the test template renders user messages only, so each has one with text)
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "user", "assistant", "system"]),
                "content": st.one_of(
                    words, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), min_size=1)
                ),
            }
        ),
        max_size=3,
    ).map(lambda messages: [*messages, {"role": "user", "content": "Once upon a time"}]),
}
EXTRA_KEYS = ["stream_options", "response_format", "tools", "suffix", "top_logprobs", "user", "unknown_field"]


@st.composite
def bodies(draw, fields: dict, required: str) -> dict:
    optional = {k: v for k, v in fields.items() if k != required}
    body = draw(st.fixed_dictionaries({required: fields[required]}, optional=optional))
    for key in draw(st.lists(st.sampled_from(sorted(fields) + EXTRA_KEYS), max_size=3, unique=True)):
        body[key] = draw(anything)
    return body


completion_bodies = bodies(COMPLETION_FIELDS, "prompt")
chat_bodies = bodies(CHAT_FIELDS, "messages")


def post_raw(server: Server, path: str, body: dict) -> int:
    # allow_nan: Python's JSON (and so FastAPI's) accepts the NaN and Infinity a client could send
    code, _, payload = server.request("POST", path, raw=json.dumps(body, allow_nan=True).encode())
    assert code < 500, (code, body, payload)
    if code >= 400:
        assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
    return code


def assert_alive(server: Server) -> None:
    assert server.request("GET", "/health")[0] == 200
    code, _, payload = server.request("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 3, "temperature": 0})
    assert code == 200 and payload["usage"]["completion_tokens"] == 3, payload


FUZZ = settings(
    max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(body=completion_bodies, nan=st.sampled_from([None, "temperature", "presence_penalty", "top_p"]))
def test_fuzzed_completions_never_stop_the_engine(server, body: dict, nan) -> None:
    if nan is not None:
        body = {**body, nan: float("nan")}
    post_raw(server, "/v1/completions", body)
    assert_alive(server)


@FUZZ
@given(body=chat_bodies)
def test_fuzzed_chats_never_stop_the_engine(server, body: dict) -> None:
    post_raw(server, "/v1/chat/completions", body)
    assert_alive(server)


SCHEMATHESIS_CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
    "response_schema_conformance,negative_data_rejection,missing_required_header,unsupported_method,"
    "allow_header_conformance"
)


def test_the_server_matches_its_openapi_document(server, tmp_path) -> None:
    """schemathesis generates requests from /openapi.json, valid and invalid, and checks each answer against
    the document: no 5xx, only documented status codes and content types, bodies (and every Server-Sent
    Event) that match their schema, and invalid input always refused."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"http://127.0.0.1:{server.port}/openapi.json"]
    command += ["--checks", SCHEMATHESIS_CHECKS, "--max-examples", "25", "--workers", "1", "--seed", "20261201"]
    command += ["--no-color", "--continue-on-failure", "--request-timeout", "60"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and not re.search(r"(?<!\d)0 passed", result.stdout)
    assert_alive(server)
