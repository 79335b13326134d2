"""Known attack classes on OpenAI-compatible servers (vLLM's security advisories of 2025-2026) against a real
`pagoda serve`. For each class: the hostile request is refused with a 4xx OpenAI error in under 2 s, /health
stays fast (p99 < 100 ms) while the attack repeats, and the server holds no more threads, fds or memory after
it than before (see security_helpers for the slack and why).

The output parsers are attacked in-process: they read the model's output, which a client steers with its
prompt, so what matters is that any 100 kB of text parses in linear time."""

import base64
import io
import json
import pickle
import socket
import time
from pathlib import Path

import pytest
from security_helpers import (
    HealthProbe,
    assert_no_growth,
    assert_openai_error,
    read_resources,
    repeat,
    send_head,
    settle,
)
from server_helpers import Server, start_server

from pagoda.config import EngineArgs
from pagoda.entrypoints.openai.api_server import build_app
from pagoda.entrypoints.openai.defaults import ServerConfig
from pagoda.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagoda.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS

pytestmark = pytest.mark.slow  # real server processes

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# A template that uses what transformers hands every template besides the messages.
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
REFUSED_IN = 2.0  # seconds a hostile request may take to be refused
REPEATS = 1000


@pytest.fixture(scope="module")
def server():
    server = start_server("--chat-template", TEMPLATE, "--max-num-seqs", "64")
    yield server
    server.stop()


def attack(server: Server, hostile, repeats: int = REPEATS, headers: dict | None = None) -> None:
    """``hostile()`` returns (status, body, seconds); each must be a 4xx OpenAI error in under REFUSED_IN s,
    repeated ``repeats`` times (8 at a time) with /health fast meanwhile, no resource growth after, and the
    server still serving (a request with ``headers``)."""
    hostile()  # warm up whatever the first refusal of a kind builds once
    before = read_resources(server.process.pid)

    def one(_: int) -> None:
        code, payload, seconds = hostile()
        assert_openai_error(code, payload)
        assert seconds < REFUSED_IN, (code, payload, seconds)

    with HealthProbe(server.port) as probe:
        repeat(repeats, one, concurrency=8)
    probe.assert_healthy(p99_s=0.1)
    assert_no_growth(before, settle(server.process.pid, before))
    assert server.request("POST", COMPLETIONS, {"prompt": "Once", "max_tokens": 2}, headers=headers)[0] == 200


def post(server: Server, path: str, body: dict, headers: dict | None = None):
    start = time.perf_counter()
    code, _, payload = server.request("POST", path, body, headers=headers)
    return code, payload, time.perf_counter() - start


# ---- output parsers: 100 kB of adversarial model output -------------------------------------------------

PARSERS = {**TOOL_CALL_PARSERS, **REASONING_PARSERS}
ADVERSARIAL = {  # each repeated to the wanted size
    "unclosed tool_call": "<tool_call>",
    "open names": '{"name":',
    "nested braces": "{",
    "nested brackets": "[",
    "whitespace": " ",
    "newlines": "\n",
    "unclosed think": "<think>",
    "mistral markers": "[TOOL_CALLS]",
    "mistral name and blanks": "[TOOL_CALLS]a" + " " * 50,
    "mistral args and blanks": "[TOOL_CALLS]a [ARGS]" + "\t" * 50,
    "llama tag and blanks": "<|python_tag|>" + " " * 50,
    "closed calls": '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
}


def _text(unit: str, size: int) -> str:
    # A whitespace unit is one run after a single prefix (a run is what backtracks); others simply repeat.
    if unit.strip() != unit and unit.strip():
        head = unit.rstrip()
        return head + unit[len(head) :] * ((size - len(head)) // (len(unit) - len(head))) + "x"
    return unit * (size // len(unit))


def _parse_seconds(parser, text: str, stream: bool) -> float:
    start = time.perf_counter()
    if stream:
        streamer = parser.streamer()
        for i in range(0, len(text), 4):  # about a token at a time
            streamer.feed(text[i : i + 4])
        streamer.finish()
    else:
        parser.extract(text)
    return time.perf_counter() - start


@pytest.mark.parametrize("stream", [False, True], ids=["extract", "stream"])
@pytest.mark.parametrize("parser_name", sorted(PARSERS))
def test_parsers_read_100kB_of_adversarial_output_in_linear_time(parser_name: str, stream: bool) -> None:
    parser = PARSERS[parser_name]()
    slow = []
    for case, unit in ADVERSARIAL.items():
        small = min(_parse_seconds(parser, _text(unit, 10_000), stream) for _ in range(3))
        # Linear is 10x for 10x the text, quadratic 100x; the floor keeps timer noise on tiny times out of it,
        # and a slow run is measured twice more (the best of three) so that a GC pause is not read as quadratic.
        bound = min(1.0, 25 * max(small, 0.002))
        large = _parse_seconds(parser, _text(unit, 100_000), stream)
        for _ in range(2 if large > bound else 0):
            large = min(large, _parse_seconds(parser, _text(unit, 100_000), stream))
        if large > bound:
            slow.append(f"{case}: 10 kB {small * 1000:.1f} ms, 100 kB {large * 1000:.1f} ms")
    assert not slow, slow


# ---- n: the sequences one request asks for ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "Once", "n": 10**6}, "--max-n"),
        ({"prompt": "Once", "n": 129}, "--max-n"),  # the default --max-n is 128
        ({"prompt": [[1]] * 9, "n": 128, "max_tokens": 512}, "--max-num-queued-requests"),  # 1,152 sequences
        ({"prompt": "Once", "n": 2, "max_tokens": 10**9}, "maximum context length"),
    ],
)
def test_huge_n_is_refused_at_once(server, body: dict, message: str) -> None:
    code, payload, seconds = post(server, COMPLETIONS, body)
    assert_openai_error(code, payload, 400)
    assert message in payload["error"]["message"] and seconds < REFUSED_IN


def test_huge_n_repeated_leaves_nothing_behind(server) -> None:
    attack(server, lambda: post(server, COMPLETIONS, {"prompt": [[1]] * 9, "n": 128}))


# ---- chat_template_kwargs: never the server's own template arguments -----------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"messages": [{"role": "user", "content": "injected"}]},
        {"add_generation_prompt": False},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"chat_template": "{{ 'injected' }}"},
        {"tokenize": True},
        {"return_dict": True},
        {"conversation": []},
        {"eos_token": "injected " * 50},
        {"bos_token": ""},
        {"raise_exception": "x"},
    ],
    ids=lambda kwargs: next(iter(kwargs)),
)
def test_chat_template_kwargs_cannot_override_the_servers_arguments(server, kwargs: dict) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": kwargs}
    code, payload, seconds = post(server, CHAT, body)
    assert_openai_error(code, payload, 400)
    assert payload["error"]["param"] == "chat_template_kwargs" and seconds < REFUSED_IN


def test_chat_template_kwargs_of_the_template_itself_still_reach_it(server) -> None:
    plain = post(server, CHAT, {"messages": MESSAGES, "max_tokens": 1})
    extra = post(server, CHAT, {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": 0}})
    assert plain[0] == extra[0] == 200
    assert plain[1]["usage"]["prompt_tokens"] == extra[1]["usage"]["prompt_tokens"]


def test_overriding_template_arguments_repeated_leaves_nothing_behind(server) -> None:
    body = {"messages": MESSAGES, "chat_template_kwargs": {"eos_token": "x"}}
    attack(server, lambda: post(server, CHAT, body))


# ---- prompt_embeds: serialized tensors are refused, never deserialized -----------------------------------


class _Marker:
    """Unpickling this touches a file: proof, if the file appears, that the server unpickled client bytes."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _payloads(marker: Path) -> list[str]:
    import torch

    tensor = io.BytesIO()
    torch.save(torch.zeros(4, 8), tensor)
    evil = io.BytesIO()
    torch.save({"x": _Marker(str(marker))}, evil)  # torch.load(weights_only=False) would run Path.touch
    raw = pickle.dumps(_Marker(str(marker)))
    return [base64.b64encode(data).decode() for data in (tensor.getvalue(), evil.getvalue(), raw)]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_prompt_embeds_are_refused_and_never_deserialized(server, tmp_path, path: str) -> None:
    marker = tmp_path / "unpickled"
    base = {"prompt": "Once"} if path == COMPLETIONS else {"messages": MESSAGES}
    for embeds in [*_payloads(marker), [_payloads(marker)[0]], []]:
        code, payload, seconds = post(server, path, {**base, "max_tokens": 1, "prompt_embeds": embeds})
        assert_openai_error(code, payload, 400)
        assert payload["error"]["param"] == "prompt_embeds" and seconds < REFUSED_IN
    assert not marker.exists()
    # chat content parts carrying embeddings (vLLM's image_embeds) are refused too: content is text only
    part = {"type": "image_embeds", "image_embeds": _payloads(marker)[0]}
    code, payload, _ = post(server, CHAT, {"messages": [{"role": "user", "content": [part]}]})
    assert_openai_error(code, payload, 400)
    assert not marker.exists()


def test_prompt_embeds_repeated_leave_nothing_behind(server, tmp_path) -> None:
    body = {"prompt": "Once", "prompt_embeds": _payloads(tmp_path / "unpickled")[1]}
    attack(server, lambda: post(server, COMPLETIONS, body))


# ---- huge request heads ------------------------------------------------------------------------------------


ONE_MB_HEADER = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n"
MANY_HEADERS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(10_000)) + b"\r\n"


@pytest.mark.parametrize("head", [ONE_MB_HEADER, MANY_HEADERS], ids=["1 MB header", "10k headers"])
def test_a_huge_request_head_is_a_431_openai_error(server, head: bytes) -> None:
    status, payload, seconds = send_head(server, head)
    assert_openai_error(status, payload, 431)
    assert payload["error"]["code"] == "request_header_fields_too_large" and seconds < REFUSED_IN


def test_a_malformed_request_head_is_a_400_openai_error(server) -> None:
    status, payload, _ = send_head(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
    assert_openai_error(status, payload, 400)


def test_huge_request_heads_repeated_leave_nothing_behind(server) -> None:
    attack(server, lambda: send_head(server, MANY_HEADERS))
    attack(server, lambda: send_head(server, ONE_MB_HEADER), repeats=200)  # 200 MB is enough to show a leak


# ---- streams the client walks away from ----------------------------------------------------------------------


def _open_streams(server: Server, count: int) -> list[socket.socket]:
    """``count`` streamed completions, all sent before any is read, each read until its first token."""
    body = json.dumps({"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(count)]
    for sock in socks:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
    for sock in socks:
        reader = sock.makefile("rb")
        while not reader.readline().startswith(b"data: "):  # until the first token: it runs
            pass
    return socks


def _wait_for(server: Server, metric: str, value: float, timeout: float = 15) -> float:
    deadline = time.monotonic() + timeout
    while (now := server.metric(metric)) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_streams_closed_mid_way_release_their_requests_blocks_and_sockets(server) -> None:
    _wait_for(server, "vllm:num_requests_running", 0)
    before = read_resources(server.process.pid)
    with HealthProbe(server.port) as probe:
        for _ in range(2):  # 100 streams in all
            streams = _open_streams(server, 50)
            assert server.metric("vllm:num_requests_running") > 0
            for sock in streams:
                # SO_LINGER 0: close with a reset, as a killed client does, not a polite FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.close()
            assert _wait_for(server, "vllm:num_requests_running", 0) == 0
            assert _wait_for(server, "vllm:num_requests_waiting", 0) == 0
            assert _wait_for(server, "vllm:kv_cache_usage_perc", 0) == 0  # every block is free again
    probe.assert_healthy(p99_s=0.1)
    assert_no_growth(before, settle(server.process.pid, before))
    assert server.request("POST", COMPLETIONS, {"prompt": "Once", "max_tokens": 2})[0] == 200


# ---- the API key: every route but the probes, whatever the path looks like ------------------------------------

KEY = "regression-suite-key"
KEYED_FLAGS = ("--api-key", KEY, "--enable-lora", "--allow-runtime-lora-updates")
# What answers without a key: the probes and the Prometheus scrape (auth.DEFAULT_EXEMPT_PATHS). vLLM checks the
# key only under /v1; Pagoda checks every other route too (/version, /tokenize, /openapi.json, /docs included).
PUBLIC_PATHS = {"/health", "/ready", "/metrics"}
# /lora_adapters is the operator's read of adapter status; its auth is decided with the LoRA routes (the lead's).
LEAD_OWNED_PATHS = {"/lora_adapters"}


@pytest.fixture(scope="module")
def keyed():
    server = start_server(*KEYED_FLAGS)
    yield server
    server.stop()


def every_route() -> list[tuple[str, str]]:
    """(method, path) of every route of the app `pagoda serve` builds with KEYED_FLAGS (path parameters filled)."""
    config = ServerConfig(engine_args=EngineArgs(enable_lora=True), api_keys=(KEY,), allow_runtime_lora_updates=True)
    routes = []
    for route in build_app(config).routes:
        for method in sorted(getattr(route, "methods", None) or ["GET"]):
            routes.append((method, route.path.replace("{", "").replace("}", "")))
    return routes


def test_every_route_but_the_public_ones_needs_the_key(keyed) -> None:
    _, _, documented = keyed.request("GET", "/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    routes = every_route()
    # the enumeration misses no served route (path parameters appear without their braces on both sides)
    assert {p.replace("{", "").replace("}", "") for p in documented["paths"]} <= {path for _, path in routes}
    answers = {}
    for method, path in routes:
        if path in LEAD_OWNED_PATHS:
            continue
        code, _, _ = keyed.request(method, path, {} if method == "POST" else None)
        wrong, _, _ = keyed.request(method, path, {} if method == "POST" else None, {"Authorization": "Bearer nope"})
        answers[(method, path)] = (code, wrong)
    protected = {route: codes for route, codes in answers.items() if route[1] not in PUBLIC_PATHS}
    assert {codes for codes in protected.values()} == {(401, 401)}, protected
    assert all(codes[0] != 401 for route, codes in answers.items() if route[1] in PUBLIC_PATHS), answers


TRICKS = [
    "//v1/models",
    "/v1/models/",
    "/V1/models",
    "/v1//models",
    "/v1/%6Dodels",  # percent-encoded 'm': uvicorn decodes it, so it routes to /v1/models
    "/%2Fv1/models",
    "/v1/models%2F",
    "/health/../v1/models",
    "/health%2F..%2Fv1%2Fmodels",
    "/./v1/models",
    "/metrics/../v1/models",
    "/v1/models?path=/health",
    "/v1/models#/health",
    "/health/",
    "/HEALTH",
]


@pytest.mark.parametrize("path", TRICKS)
def test_path_tricks_do_not_bypass_the_key(keyed, path: str) -> None:
    code, _, payload = keyed.request("GET", path)
    assert code == 401, (path, code, payload)
    assert_openai_error(code, payload)


def test_an_absolute_request_target_does_not_bypass_the_key(keyed) -> None:
    status, payload, _ = send_head(keyed, b"GET http://127.0.0.1/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 401, payload


def test_unauthenticated_requests_repeated_leave_nothing_behind(keyed) -> None:
    wrong = {"Authorization": "Bearer bad"}
    attack(
        keyed, lambda: post(keyed, COMPLETIONS, {"prompt": "Once"}, wrong), headers={"Authorization": f"Bearer {KEY}"}
    )
