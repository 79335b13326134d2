"""The API client's own HTTP behaviour (retries, Retry-After, token file refresh, status mapping), against a small
aiohttp server on 127.0.0.1 standing in for the API server: a real kube-apiserver cannot be told to answer 429 or
503 on cue, nor to switch the token it accepts."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest
import pytest_asyncio
from aiohttp import web

from pagoda_operator.kube import KubeClient, KubeError, RetryPolicy

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

CM = "/api/v1/namespaces/ns/configmaps"
FAST = RetryPolicy(base_delay=0.01, max_delay=0.05)  # backoff without Retry-After need not slow the tests down


@contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port bound without listening, so every connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@dataclass
class FakeApiServer:
    """Answers each request with the next scripted reply (then 200 with the object), and records what came in."""

    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    accepted_token: str | None = None  # when set, any other bearer token gets a 401
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.text()
        self.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "authorization": request.headers.get("Authorization"),
                "content_type": request.headers.get("Content-Type"),
                "body": body,
                "at": time.monotonic(),
            }
        )
        if self.accepted_token is not None and request.headers.get("Authorization") != f"Bearer {self.accepted_token}":
            return web.json_response({"kind": "Status", "code": 401, "message": "Unauthorized"}, status=401)
        if self.script:
            status, headers = self.script.pop(0)
            payload = {"kind": "Status", "code": status, "message": f"scripted {status}"}
            return web.json_response(payload, status=status, headers=headers)
        return web.json_response({"kind": "ConfigMap", "metadata": {"name": request.path.rsplit("/", 1)[-1]}})


@pytest_asyncio.fixture()
async def server() -> AsyncIterator[tuple[FakeApiServer, str]]:
    fake = FakeApiServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest_asyncio.fixture()
async def client_factory() -> AsyncIterator[Callable[..., KubeClient]]:
    clients: list[KubeClient] = []

    def make(url: str, **kwargs: Any) -> KubeClient:
        kwargs.setdefault("retry", FAST)
        clients.append(KubeClient(kopf.ConnectionInfo(server=url, token="static"), **kwargs))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


async def test_a_429_with_retry_after_and_a_503_are_retried_until_the_request_succeeds(server, client_factory) -> None:
    fake, url = server
    fake.script = [(429, {"Retry-After": "1"}), (503, {})]
    kube = client_factory(url)
    assert await kube.get(f"{CM}/a") == {"kind": "ConfigMap", "metadata": {"name": "a"}}
    first, second, third = fake.requests
    assert second["at"] - first["at"] >= 0.95  # Retry-After: 1 was honoured ...
    assert third["at"] - second["at"] < 0.5  # ... and the 503 got the (fast) backoff, not another second
    assert {r["path"] for r in fake.requests} == {f"{CM}/a"}


async def test_a_create_is_retried_after_a_429_but_not_replayed_after_a_503(server, client_factory) -> None:
    fake, url = server
    kube = client_factory(url)
    fake.script = [(429, {"Retry-After": "0"})]
    await kube.create(CM, {"metadata": {"name": "b"}})  # rejected before it ran: safe to send again
    assert len(fake.requests) == 2
    fake.script = [(503, {})]
    with pytest.raises(KubeError) as raised:
        await kube.create(CM, {"metadata": {"name": "c"}})  # it may have been created: a replay could fail as 409
    assert raised.value.status == 503 and "scripted 503" in str(raised.value)
    assert len(fake.requests) == 3


async def test_retries_stop_after_the_policy_s_attempts(server, client_factory) -> None:
    fake, url = server
    fake.script = [(503, {})] * 10
    kube = client_factory(url, retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01))
    with pytest.raises(KubeError) as raised:
        await kube.get(f"{CM}/d")
    assert raised.value.status == 503 and len(fake.requests) == 3


async def test_a_refused_connection_is_retried_then_raised_as_a_client_error(client_factory) -> None:
    with refused_port() as port:
        kube = client_factory(f"http://127.0.0.1:{port}", retry=RetryPolicy(attempts=3, base_delay=0.01))
        started = time.monotonic()
        with pytest.raises(aiohttp.ClientConnectorError):
            await kube.get(f"{CM}/e")
    assert time.monotonic() - started < 5


async def test_status_mapping_404_and_apply_parameters(server, client_factory) -> None:
    fake, url = server
    kube = client_factory(url)
    fake.script = [(404, {}), (404, {})]
    assert await kube.get(f"{CM}/missing") is None
    assert await kube.delete(f"{CM}/missing") is False
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "f", "namespace": "ns"}, "data": {"k": "v"}}
    await kube.apply(obj, manager="someone", dry_run=True)
    applied = fake.requests[-1]
    assert applied["method"] == "PATCH" and applied["path"] == f"{CM}/f"
    assert applied["content_type"] == "application/apply-patch+yaml"
    assert applied["query"] == {"fieldManager": "someone", "force": "true", "dryRun": "All"}
    assert applied["authorization"] == "Bearer static"


async def client_with_token_file(server, client_factory, token: Path, value: str) -> KubeClient:
    """A client reading its token from the file ``token`` (holding ``value``, which the server accepts), after its
    first request with it."""
    fake, url = server
    token.write_text(value)
    fake.accepted_token = value.strip()
    kube = client_factory(url, token_file=str(token))
    await kube.get(f"{CM}/token")
    return kube


async def test_a_rewritten_token_file_is_used_from_the_next_request_on(server, client_factory, tmp_path: Path) -> None:
    fake, _ = server
    token = tmp_path / "token"
    kube = await client_with_token_file(server, client_factory, token, "first-token\n")
    # What the kubelet does when it rotates a projected token: a new file swapped in by rename.
    (tmp_path / "token.new").write_text("second-token\n")
    os.replace(tmp_path / "token.new", token)
    fake.accepted_token = "second-token"
    await kube.get(f"{CM}/token")
    assert [r["authorization"] for r in fake.requests] == ["Bearer first-token", "Bearer second-token"]


async def test_a_401_rereads_the_token_file_and_retries_once(server, client_factory, tmp_path: Path) -> None:
    fake, _ = server
    token = tmp_path / "token"
    kube = await client_with_token_file(server, client_factory, token, "aaaa")
    # Rewritten in place with the same size and mtime: a change the file check cannot see, only the 401 reveals.
    stat = token.stat()
    token.write_text("bbbb")
    os.utime(token, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    fake.accepted_token = "bbbb"
    await kube.get(f"{CM}/token")
    assert [r["authorization"] for r in fake.requests] == ["Bearer aaaa", "Bearer aaaa", "Bearer bbbb"]
    fake.accepted_token = "cccc"  # a token the file does not hold: one re-read, then the 401 stands
    with pytest.raises(KubeError) as raised:
        await kube.get(f"{CM}/token")
    assert raised.value.status == 401 and len(fake.requests) == 5
