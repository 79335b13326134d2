"""`pagoda router` as a real process, with ``--static-models``, in front of real `pagoda serve` processes (the
built-in stories260K, served as ``alpha`` and ``beta``) and small stand-in upstreams, reached with the official
``openai`` client: requests land on the model's own pods, streams pass through as they come, ``/v1/models`` merges
every model and adapter, errors are OpenAI's, the API key is enforced, a pod that is gone or answers 503 before any
byte is skipped for another, and a model with no endpoint holds its requests until one comes or the hold times out.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from router_helpers import RouterProcess, running_router, write_static_models
from stand_in_upstream import StandInUpstream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import CHAT_TEMPLATE, Server, start_server  # noqa: E402

pytestmark = pytest.mark.slow
HOLD_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Server]]:
    started: dict[str, Server] = {}
    try:
        for name in ("alpha", "beta"):
            args = ("--chat-template", CHAT_TEMPLATE, "--max-model-len", "256", "--served-model-name", name)
            started[name] = start_server(*args)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def stand_ins() -> Iterator[dict[str, StandInUpstream]]:
    ups = {
        name: StandInUpstream(mode=mode, name=name).start()
        for name, mode in (
            ("ok", "ok"),
            ("busy1", "503"),
            ("busy2", "503"),
            ("gone", "ok"),
            ("drop", "drop"),
            ("cut", "cut"),
        )
    }
    yield ups
    for up in ups.values():
        up.stop()


@pytest.fixture(scope="module")
def models_file(tmp_path_factory, engines, stand_ins) -> Path:
    path = tmp_path_factory.mktemp("router") / "models.yaml"
    ok = stand_ins["ok"].url
    return write_static_models(
        path,
        [
            {"name": "alpha", "endpoints": [engines["alpha"].base_url[: -len("/v1")]]},
            {"name": "beta", "endpoints": [engines["beta"].base_url[: -len("/v1")]]},
            {"name": "gamma", "adapters": ["gamma-sql"], "endpoints": [ok], "namespace": "ns", "deployment": "g"},
            {"name": "flaky", "endpoints": [stand_ins["busy1"].url, stand_ins["busy2"].url, ok]},
            {"name": "dying", "endpoints": [stand_ins["gone"].url, stand_ins["drop"].url, ok]},
            {"name": "cut", "endpoints": [stand_ins["cut"].url, ok]},
            {"name": "empty", "endpoints": [], "namespace": "ns", "deployment": "empty"},
        ],
    )


@pytest.fixture(scope="module")
def router(models_file: Path, tmp_path_factory, stand_ins) -> Iterator[RouterProcess]:
    # Scrapes once at start, then rarely: the stand-in that is stopped later still looks idle, so it gets picked.
    args = ("--static-models", str(models_file), "--hold-timeout", str(HOLD_TIMEOUT), "--load-interval", "60")
    with running_router(*args, log_path=tmp_path_factory.mktemp("router-log") / "router.log") as process:
        deadline = time.monotonic() + 10
        while stand_ins["gone"].scrapes == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        yield process


def client(router: RouterProcess, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key=key, max_retries=0, timeout=60)


def test_each_model_lands_on_its_own_engine_streamed_or_not(router, engines) -> None:
    before = {name: server.metric("vllm:request_success_total") for name, server in engines.items()}
    c = client(router)
    for model, count in (("alpha", 3), ("beta", 2)):
        for _ in range(count):
            reply = c.completions.create(model=model, prompt="Once upon a time", max_tokens=4)
            assert reply.model == model and reply.choices[0].text
    chat = c.chat.completions.create(model="beta", messages=[{"role": "user", "content": "Once"}], max_tokens=4)
    assert chat.model == "beta" and chat.choices[0].message.content
    stream = c.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "Once"}], max_tokens=6, stream=True
    )
    chunks = [chunk for chunk in stream]
    assert len(chunks) > 2 and "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    gained = {name: server.metric("vllm:request_success_total") - before[name] for name, server in engines.items()}
    assert gained == {"alpha": 4, "beta": 3}
    assert router.metric_when("pagoda_router_requests_total", 4, model="alpha", code="200") == 4


def test_models_lists_every_model_and_adapter(router) -> None:
    listed = {m.id: m for m in client(router).models.list()}
    assert set(listed) == {"alpha", "beta", "gamma", "gamma-sql", "flaky", "dying", "cut", "empty"}
    assert all(m.owned_by == "pagoda" for m in listed.values())
    assert listed["gamma-sql"].model_extra["parent"] == "gamma" and listed["alpha"].model_extra["parent"] is None


def test_an_adapter_goes_to_its_models_endpoints_with_body_and_authorization_unchanged(router, stand_ins) -> None:
    ok = stand_ins["ok"]
    seen = len(ok.seen)
    body = {"model": "gamma-sql", "prompt": "select", "max_tokens": 3, "extra_field": [1, 2]}
    status, _, reply = router.request("POST", "/v1/completions", body, headers={"Authorization": "Bearer client"})
    assert status == 200 and reply["choices"][0]["text"] == "from ok"
    assert ok.seen[seen].body == body and ok.seen[seen].headers["Authorization"] == "Bearer client"


def test_errors_are_openai_shaped(router) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client(router).completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert missing.value.body["code"] == "model_not_found"
    status, _, reply = router.request("POST", "/v1/chat/completions", raw=b'{"model": "alpha", ')
    assert status == 400 and set(reply["error"]) == {"message", "type", "param", "code"}
    assert router.request("POST", "/v1/completions", raw=b"[1, 2]")[0] == 400
    status, _, reply = router.request("GET", "/v1/no/such/path")
    assert status == 404 and "error" in reply


def test_a_503_before_any_byte_is_retried_elsewhere(router, stand_ins) -> None:
    busy = [stand_ins["busy1"], stand_ins["busy2"]]
    before = sum(len(b.seen) for b in busy)
    for i in range(8):
        reply = client(router).completions.create(model="flaky", prompt=f"prompt {i} " * 40, max_tokens=2)
        assert reply.choices[0].text == "from ok"
    assert sum(len(b.seen) for b in busy) > before  # some requests met a 503 first, and still succeeded
    assert router.metric("pagoda_router_upstream_retries_total", model="flaky") > 0


def test_a_closed_port_or_a_dropped_connection_is_retried_elsewhere(router, stand_ins) -> None:
    stand_ins["gone"].stop()  # its port is closed now; the router scraped it as idle at start
    dropped = len(stand_ins["drop"].seen)
    for i in range(8):
        reply = client(router).completions.create(model="dying", prompt=f"story {i} " * 40, max_tokens=2)
        assert reply.choices[0].text == "from ok"
    assert len(stand_ins["drop"].seen) > dropped
    assert "unreachable" in router.log()


def test_a_stream_passes_through_as_it_comes_and_a_client_that_leaves_aborts_it(router, stand_ins) -> None:
    ok = stand_ins["ok"]
    ok.stream_closed.clear()
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"model": "gamma", "prompt": "x", "stream": True}))
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    # The stand-in holds back its second event until told: the first must reach us without it.
    assert response.readline() == b'data: {"n": 1}\n'
    conn.close()  # the client leaves mid-stream: the router must drop the upstream connection
    assert ok.stream_closed.wait(10)


def test_a_stream_cut_after_its_first_bytes_is_not_retried_and_reaches_the_client_cut(router, stand_ins) -> None:
    cut, ok = stand_ins["cut"], stand_ins["ok"]
    ok.open_gate()
    before, outcomes = len(cut.seen) + len(ok.seen), []
    for i in range(6):
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
        body = {"model": "cut", "prompt": f"tale {i} " * 40, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body))
        response = conn.getresponse()
        try:
            outcomes.append(response.read())
        except http.client.IncompleteRead as partial:
            outcomes.append(b"CUT:" + partial.partial)
        conn.close()
    assert len(cut.seen) + len(ok.seen) - before == 6  # one upstream each: nothing was sent twice
    assert outcomes.count(b'CUT:data: {"n": 1}\n\n') == len(cut.seen) > 0
    assert all(o.endswith(b"data: [DONE]\n\n") for o in outcomes if not o.startswith(b"CUT:"))


def test_a_model_with_no_endpoint_answers_503_with_retry_after_once_the_hold_times_out(router) -> None:
    started = time.monotonic()
    status, headers, reply = router.request("POST", "/v1/completions", {"model": "empty", "prompt": "x"})
    waited = time.monotonic() - started
    assert status == 503 and int(headers["Retry-After"]) > 0 and reply["error"]["type"] == "service_unavailable"
    assert HOLD_TIMEOUT - 0.1 <= waited < HOLD_TIMEOUT + 3


def test_a_held_request_goes_through_once_its_model_has_an_endpoint(router, models_file, stand_ins) -> None:
    listed = yaml.safe_load(models_file.read_text())["models"]
    later = {"name": "later", "endpoints": []}
    write_static_models(models_file, [*listed, later])
    deadline = time.monotonic() + 10
    while "later" not in {m.id for m in client(router).models.list()} and time.monotonic() < deadline:
        time.sleep(0.1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(router.request, "POST", "/v1/completions", {"model": "later", "prompt": "x"})
        time.sleep(0.5)
        assert not job.done()  # held
        assert router.metric("pagoda_router_held_requests") == 1
        write_static_models(models_file, [*listed, {**later, "endpoints": [stand_ins["ok"].url]}])
        status, _, reply = job.result(timeout=10)
    assert status == 200 and reply["model"] == "later"
    assert router.metric("pagoda_router_held_requests") == 0


def test_the_api_key_is_enforced_and_the_pods_get_their_own(tmp_path, stand_ins) -> None:
    ok = stand_ins["ok"]
    models = write_static_models(tmp_path / "models.yaml", [{"name": "gamma", "endpoints": [ok.url]}])
    env = {**os.environ, "PAGODA_ROUTER_API_KEY": "router-key"}
    args = ("--static-models", str(models), "--upstream-api-key", "pod-key")
    with running_router(*args, log_path=tmp_path / "router.log", env=env) as guarded:
        with pytest.raises(openai.AuthenticationError):
            client(guarded, "wrong").completions.create(model="gamma", prompt="x", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            client(guarded, "wrong").models.list()
        seen = len(ok.seen)
        reply = client(guarded, "router-key").completions.create(model="gamma", prompt="x", max_tokens=1)
        assert reply.choices[0].text == "from ok" and ok.seen[seen].headers["Authorization"] == "Bearer pod-key"
        assert guarded.request("GET", "/health")[0] == 200  # probes need no key
