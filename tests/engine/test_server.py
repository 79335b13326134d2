"""`pagoda serve` as clients use it: the real `openai` package against a real server process."""

import json
import threading
import time

import openai
import pytest
from server_helpers import CHAT_TEMPLATE, start_server

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts real server processes

MODEL = "stories260K"


@pytest.fixture(scope="module")
def server():
    server = start_server("--chat-template", CHAT_TEMPLATE, "--max-model-len", "256")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(max_model_len=256)


def test_models_lists_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == MODEL


def test_completion_equals_the_offline_path_token_for_token(client, offline):
    response = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    (expected,) = offline.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert response.choices[0].text == expected.outputs[0].text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == 5 and response.usage.completion_tokens == 12
    assert response.usage.total_tokens == 17


def test_streamed_completion_adds_up_and_reports_usage(client):
    whole = client.completions.create(model=MODEL, prompt="Tim and Sue", max_tokens=16, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt="Tim and Sue",
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16


def test_completion_prompt_forms_n_echo_logprobs_and_stop(client):
    response = client.completions.create(
        model=MODEL, prompt=["Once upon a time", "Tim and Sue"], max_tokens=4, temperature=0, n=2, echo=True, logprobs=2
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text.startswith("Once upon a time")
    # echo: the logprobs cover the prompt's 5 tokens (the first one has none) and the 4 generated
    assert len(response.choices[0].logprobs.tokens) == 5 + 4
    assert response.choices[0].logprobs.token_logprobs[0] is None
    assert all(len(top) >= 2 for top in response.choices[0].logprobs.top_logprobs[1:])
    stopped = client.completions.create(model=MODEL, prompt=[1], max_tokens=64, temperature=0, stop=["Lily"])
    assert stopped.choices[0].text == "Once upon a time, there was a little girl named "
    assert stopped.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_over_http(client, offline):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    (offline_out,) = offline.generate(
        "Once upon a time", SamplingParams(max_tokens=16, temperature=1.0, seed=42), use_tqdm=False
    )
    assert first == second == offline_out.outputs[0].text


def test_chat_plain_and_streamed_with_logprobs(client):
    messages = [{"role": "user", "content": "Once upon a time"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content.startswith(", there was a little girl")
    assert len(choice.logprobs.content) == 8 and len(choice.logprobs.content[0].top_logprobs) == 2
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.completion_tokens == 8
    two = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=2, temperature=1.0, seed=3)
    assert [c.index for c in two.choices] == [0, 1]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * 300, "max_tokens": 4}, 400, None),
        ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("/v1/completions", {}, 400, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
            400,
            "response_format",
        ),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    code, _, payload = server.request("POST", path, body)
    assert code == status, payload
    error = payload["error"]
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert param in (error.get("param") or "") or param in error["message"]


def test_malformed_json_is_a_400(server):
    code, _, payload = server.request("POST", "/v1/completions", raw=b'{"prompt": ')
    assert code == 400 and "error" in payload


def test_metrics_move_with_traffic(server, client):
    before = server.metric("vllm:generation_tokens_total")
    client.completions.create(model=MODEL, prompt="Lily", max_tokens=5, temperature=0)
    assert server.metric("vllm:generation_tokens_total") == before + 5
    assert server.metric("vllm:request_success_total") >= 1
    assert server.metric("vllm:time_to_first_token_seconds_count") >= 1
    _, _, text = server.request("GET", "/metrics")
    assert f'model_name="{MODEL}"' in text
    assert "vllm:cache_config_info" in text


def test_a_disconnected_stream_frees_its_blocks(server):
    import http.client

    aborted_before = _aborted(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"prompt": "Once upon a time", "max_tokens": 250, "n": 8, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.fp.readline()  # the first event arrived: the request is running
    conn.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert _aborted(server) == aborted_before + 1  # aborted, not finished


def _aborted(server) -> float:
    _, _, text = server.request("GET", "/metrics")
    lines = [line for line in str(text).splitlines() if line.startswith("vllm:request_success_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'finished_reason="abort"' in line)


def test_a_disconnected_non_streaming_request_is_aborted_too():
    import http.client

    server = start_server()
    try:
        # 16 sequences x 500 tokens: seconds of work, far longer than the server's 0.5 s disconnect poll.
        body = {"prompt": "Once upon a time", "max_tokens": 500, "n": 16, "ignore_eos": True}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + 10
        while server.metric("vllm:num_requests_running") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.metric("vllm:num_requests_running") > 0
        conn.close()  # gone before the response
        deadline = time.monotonic() + 20
        while server.metric("vllm:num_requests_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.metric("vllm:num_requests_running") == 0
        assert server.metric("vllm:kv_cache_usage_perc") == 0.0
        assert _aborted(server) == 1  # aborted, not finished
    finally:
        server.stop()


def test_health_ready_version_and_tokenize(server):
    assert server.request("GET", "/health")[0] == 200
    assert server.request("GET", "/ready")[0] == 200
    assert server.request("GET", "/version")[2]["version"]
    _, _, tokens = server.request("POST", "/tokenize", {"prompt": "Once upon a time"})
    assert tokens["tokens"] == [1, 403, 407, 261, 378]
    _, _, text = server.request("POST", "/detokenize", {"tokens": [403, 407, 261, 378]})
    assert text["prompt"] == "Once upon a time"


def test_api_key_guards_every_route_but_probes_metrics_and_adapter_status():
    from pagoda.config import EngineArgs
    from pagoda.entrypoints.openai.api_server import AUTH_EXEMPT_PATHS, ServerConfig, build_app

    routes = [
        (method, route.path)
        for route in build_app(ServerConfig(EngineArgs())).routes
        for method in getattr(route, "methods", None) or ()
        if method != "HEAD"
    ]
    assert ("POST", "/v1/chat/completions") in routes
    server = start_server("--api-key", "k1", "--api-key", "k2")
    try:
        for method, path in routes:
            status, _, _ = server.request(method, path, {} if method == "POST" else None)
            if path in AUTH_EXEMPT_PATHS:  # probes, /metrics and the adapter status the operator reads
                assert status == 200, path
            else:
                assert status == 401, (method, path)
                assert server.request(method, path, {}, headers={"Authorization": "Bearer wrong"})[0] == 401
        good = openai.OpenAI(base_url=server.base_url, api_key="k2", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        server.stop()


def test_a_burst_past_the_queue_limit_gets_429_and_the_admitted_requests_complete():
    # One sequence runs and two may wait. The ten requests reach the server back to back, and each
    # is long enough that none finishes during the burst, so at most three can be admitted.
    server = start_server("--max-num-queued-requests", "2", "--max-num-seqs", "1")
    body = {"prompt": [1], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    try:
        results = server.burst("/v1/completions", [{**body, **(stream if i % 2 else {})} for i in range(10)])
        admitted = [payload for code, _, payload in results if code == 200]
        assert 2 <= len(admitted) <= 3, [code for code, _, _ in results]
        for code, headers, payload in results:
            if code == 429:
                assert headers.get("retry-after") or headers.get("Retry-After")
                assert payload["error"]["type"] == "rate_limit_error"
        for payload in admitted:
            if isinstance(payload, str):  # a streamed response
                assert payload.rstrip().endswith("data: [DONE]")
                assert '"completion_tokens": 400' in payload
            else:
                assert payload["usage"]["completion_tokens"] == 400
    finally:
        server.stop()


def _sigterm_during_completions(server, count: int, max_tokens: int) -> tuple[list, list[threading.Thread]]:
    """Send ``count`` long completions at once (a thread each), then SIGTERM the server while they run.

    Returns the list each thread appends its (code, headers, payload) to, and the threads to join."""
    results: list = []
    body = {"prompt": [1], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    threads = [
        threading.Thread(target=lambda: results.append(server.request("POST", "/v1/completions", body)))
        for _ in range(count)
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)
    server.process.terminate()
    return results, threads


def test_sigterm_drains_in_flight_requests_then_exits_zero():
    # One sequence at a time, so four 400-token requests stay in flight for a while.
    server = start_server("--shutdown-timeout", "60", "--max-num-seqs", "1")
    results, threads = _sigterm_during_completions(server, 4, 400)
    time.sleep(0.2)
    assert server.request("GET", "/ready")[0] == 503
    assert server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 503
    for t in threads:
        t.join(120)
    assert [code for code, _, _ in results] == [200] * 4
    assert all(payload["usage"]["completion_tokens"] == 400 for _, _, payload in results)
    assert server.process.wait(30) == 0


def test_past_the_shutdown_timeout_the_rest_are_aborted_with_a_clear_error():
    server = start_server("--shutdown-timeout", "1", "--max-num-seqs", "1")
    results, threads = _sigterm_during_completions(server, 6, 500)
    for t in threads:
        t.join(60)
    aborted = [payload for code, _, payload in results if code == 503]
    assert aborted, [code for code, _, _ in results]
    assert all("aborted" in payload["error"]["message"] for payload in aborted)
    assert server.process.wait(30) == 0


def test_health_stays_responsive_while_the_engine_is_busy(server):
    body = {"prompt": [1], "max_tokens": 300, "ignore_eos": True, "temperature": 0.8}
    threads = [threading.Thread(target=server.request, args=("POST", "/v1/completions", body)) for _ in range(8)]
    for t in threads:
        t.start()
    latencies = []
    for _ in range(20):
        start = time.perf_counter()
        assert server.request("GET", "/health")[0] == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.02)
    for t in threads:
        t.join(120)
    # Not a speed benchmark: a probe must never wait for model compute (seconds here) on the event loop.
    assert max(latencies) < 1.0, latencies
