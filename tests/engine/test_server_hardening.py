"""A hostile client against a real `pagoda serve`: no single request may stop the engine, hold a connection
or the event loop, or get a 5xx that leaks internals. Every input here once stopped the engine for every
client, or is a limit that now bounds what one request can cost."""

import http.client
import json
import socket
import threading
import time

import pytest
from server_helpers import CHAT_TEMPLATE, Server, start_server

pytestmark = pytest.mark.slow  # starts real server processes

VOCAB = 512
ORIGIN = "http://app.example"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "serve.log")
    args = ["--chat-template", CHAT_TEMPLATE, "--max-stop-sequences", "600", "--allowed-origins", ORIGIN]
    args += ["--http-header-timeout", "2", "--http-body-timeout", "3", "--log-level", "info"]
    server = start_server(*args, log_path=log)
    yield server
    server.stop()


def assert_still_serving(server: Server) -> None:
    assert server.request("GET", "/health")[0] == 200
    code, _, body = server.request("POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4})
    assert code == 200 and body["usage"]["completion_tokens"] == 4, body


EVERY_ID = list(range(VOCAB))


HOSTILE = [
    ("/v1/completions", {"prompt": "abc\ud800", "max_tokens": 4}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "abc\ud800"}], "max_tokens": 4}, "messages"),
    ("/tokenize", {"prompt": "abc\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 8, "repetition_penalty": 1e-300}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "temperature": 1e39, "min_tokens": 1}, "temperature"),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": EVERY_ID}, None),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "temperature": 1, "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": ["Once"] * 50_000, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "n": 100_000}, "n"),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "logit_bias": {str(VOCAB): 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": [VOCAB], "max_tokens": 4}, "prompt"),
    ("/detokenize", {"tokens": [VOCAB, -1]}, "tokens"),
    ("/v1/completions", {"prompt": "Once", "echo": 0}, "echo"),
    ("/detokenize", {"tokens": [False]}, "tokens"),
    (CHAT, {"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages"),
]
# The same inputs streamed: validation finishes before a stream starts, so the answer is the same 400.
STREAMED = [(path, {**body, "stream": True}, param) for path, body, param in HOSTILE if path.startswith("/v1/")]


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE + STREAMED)
def test_each_hostile_request_fails_alone_with_a_400(server, path: str, body: dict, param) -> None:
    code, headers, payload = server.request("POST", path, body)
    assert code == 400, payload
    assert headers["content-type"] == "application/json"
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and "Traceback" not in error["message"]
    if param is not None:
        assert (error["param"] or "").startswith(param), error
    assert_still_serving(server)


def test_a_streamed_request_too_long_for_the_model_is_a_400_not_an_error_event(server) -> None:
    code, _, payload = server.request("POST", "/v1/completions", {"prompt": [1] * 600, "stream": True})
    assert code == 400 and "maximum context length is 512" in payload["error"]["message"]


def test_a_huge_body_is_a_413_and_a_huge_prompt_a_400_before_any_tokenizing(server) -> None:
    code, headers, payload = server.request("POST", "/v1/completions", raw=b'{"prompt": "' + b"a" * 20_000_000 + b'"}')
    assert code == 413 and payload["error"]["code"] == "request_too_large"
    start = time.perf_counter()
    code, _, payload = server.request("POST", "/v1/completions", {"prompt": "a" * 5_000_000, "max_tokens": 4})
    assert code == 400 and "--max-prompt-chars" in payload["error"]["message"]
    assert time.perf_counter() - start < 5  # tokenizing 5 MB takes seconds on this machine; refusing it does not
    assert_still_serving(server)


def test_big_requests_stall_neither_running_streams_nor_health(server) -> None:
    # Payloads are built first: building them while the stream is read would stall this client, not the server.
    payloads = [b'{"prompt": "' + b"a" * 20_000_000 + b'"}', json.dumps({"prompt": "a" * 5_000_000}).encode()]
    body = {"prompt": [1], "max_tokens": 500, "n": 4, "ignore_eos": True, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    while not response.fp.readline().startswith(b"data: "):  # (chunk sizes) until the first token: it runs
        pass
    arrivals = [time.perf_counter()]
    health: list[float] = []
    results: list[tuple[int, float]] = []

    def big(raw: bytes) -> None:
        time.sleep(0.2)
        results.append((server.request("POST", "/v1/completions", raw=raw)[0], time.perf_counter()))

    def probe() -> None:
        for _ in range(10):
            start = time.perf_counter()
            assert server.request("GET", "/health")[0] == 200
            health.append(time.perf_counter() - start)
            time.sleep(0.02)

    attackers = [threading.Thread(target=big, args=(raw,)) for raw in payloads] + [threading.Thread(target=probe)]
    for t in attackers:
        t.start()
    for line in response.fp:
        if line.startswith(b"data: "):
            arrivals.append(time.perf_counter())
        if line.startswith(b"data: [DONE]"):
            break
    for t in attackers:
        t.join(60)
    conn.close()
    assert sorted(code for code, _ in results) == [400, 413]
    assert max(done for _, done in results) < arrivals[-1]  # both were refused while the stream ran
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(gaps) >= 4 * 499
    assert max(gaps) < 0.5, sorted(enumerate(gaps), key=lambda g: -g[1])[:5]
    assert len(health) == 10 and max(health) < 0.5, health


def send_and_read_to_close(server: Server, data: bytes) -> bytes:
    """What the server answers a client that sends ``data`` and then nothing more (read until it closes)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_slow_clients_cannot_hold_a_connection(server) -> None:
    start = time.perf_counter()
    answer = send_and_read_to_close(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never end
    assert answer.startswith(b"HTTP/1.1 408") and 1.5 < time.perf_counter() - start < 10
    start = time.perf_counter()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    answer = send_and_read_to_close(server, head)  # the body never ends
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer
    assert 2.5 < time.perf_counter() - start < 10
    assert_still_serving(server)


def test_request_ids_are_taken_or_made_and_echoed(server) -> None:
    body = {"prompt": "Once", "max_tokens": 2}
    code, headers, payload = server.request("POST", "/v1/completions", body, headers={"X-Request-Id": "trace-42"})
    assert headers["x-request-id"] == "trace-42" and payload["id"] == "cmpl-trace-42"
    _, headers, payload = server.request("POST", "/v1/completions", body, headers={"X-Request-Id": "bad id\x7f"})
    made = headers["x-request-id"]
    assert len(made) == 32 and payload["id"] == f"cmpl-{made}"
    # two requests with one id at once are both served
    results = server.burst("/v1/completions", [{**body, "max_tokens": 50}] * 2)
    assert [code for code, _, _ in results] == [200, 200]


def test_cors_is_answered_for_allowed_origins_only(server) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    code, headers, _ = server.request("OPTIONS", "/v1/completions", headers=preflight)
    assert code == 200 and headers["access-control-allow-origin"] == ORIGIN
    _, headers, _ = server.request(
        "POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}, headers={"Origin": ORIGIN}
    )
    assert headers["access-control-allow-origin"] == ORIGIN
    _, headers, _ = server.request("GET", "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in headers


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(server) -> None:
    body = {"prompt": list(range(300, 340)), "max_tokens": 2}
    first = server.request("POST", "/v1/completions", body)[2]
    second = server.request("POST", "/v1/completions", body)[2]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # two full blocks of 16


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_is_one_info_line(server, stream: bool) -> None:
    request_id = f"gone-{int(stream)}"
    body = {"prompt": "Once", "max_tokens": 500, "n": 8, "ignore_eos": True, "stream": stream}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    if stream:
        conn.getresponse().fp.readline()
    else:
        time.sleep(0.5)
    conn.close()
    deadline = time.monotonic() + 20
    while request_id not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in server.log().splitlines() if request_id in line]
    assert len(lines) == 1 and " INFO " in lines[0] and "disconnected" in lines[0], lines
    assert "Traceback" not in server.log() and " ERROR " not in server.log()
    assert_still_serving(server)


def test_admission_counts_every_sequence_a_request_adds() -> None:
    # One sequence runs at a time and four may wait: a request of 5 prompts can never fit (400), one of 4 long
    # prompts fills the queue, and the next 2-prompt request finds it full (429) though only one request waits.
    server = start_server("--max-num-queued-requests", "4", "--max-num-seqs", "1")
    try:
        long = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
        code, _, payload = server.request("POST", "/v1/completions", {"prompt": [[1]] * 5, **long})
        assert code == 400 and "--max-num-queued-requests" in payload["error"]["message"]
        results = server.burst("/v1/completions", [{"prompt": [[1]] * 4, **long}, {"prompt": [[1], [2]], **long}])
        assert [code for code, _, _ in results] == [200, 429]
        assert len(results[0][2]["choices"]) == 4
    finally:
        server.stop()


# A server whose engine loop fails the way a lost device would: on the first step that runs a request with
# max_tokens=333. The fault is injected by this script, not by any switch in the product.
FAULTY_ENGINE = """
import sys
from pagoda.engine.llm_engine import LLMEngine

step = LLMEngine.step

def faulty(self):
    if any(r.sampling_params.max_tokens == 333 for r in self.scheduler.running):
        raise RuntimeError("simulated device fault: secret-internal-detail")
    return step(self)

LLMEngine.step = faulty
from pagoda.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_failed_engine_loop_answers_503_without_internals_and_exits_non_zero(tmp_path) -> None:
    server = start_server(program=("-c", FAULTY_ENGINE), log_path=str(tmp_path / "serve.log"))
    try:
        code, _, payload = server.request("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 333})
        assert code == 503 and "secret-internal-detail" not in json.dumps(payload)
        try:
            health, _, body = server.request("GET", "/health")
            assert health == 503 and "secret-internal-detail" not in json.dumps(body)
        except OSError:
            pass  # already gone
        assert server.process.wait(30) == 1
        assert "secret-internal-detail" in server.log()  # the cause is in the log, for the operator
    finally:
        if server.process.poll() is None:
            server.process.kill()
