"""The router following real engines' KV events: two `pagoda serve` processes publish with ``--kv-events-config``,
the router (``--static-models`` with each endpoint's ``kvEvents``/``kvReplay`` addresses) subscribes, and a token
prompt is routed to the engine whose events say it holds the prompt's blocks, even one the router never sent there.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from router_helpers import RouterProcess, free_port, running_router, write_static_models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import Server, start_server  # noqa: E402

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture(scope="module")
def engines() -> Iterator[list[tuple[Server, str, str]]]:
    """Two engines of the built-in model, each publishing KV events on ports of its own."""
    started: list[tuple[Server, str, str]] = []
    try:
        for _ in range(2):
            events, replay = free_port(), free_port()
            config = {
                "enable_kv_cache_events": True,
                # a wildcard address is bound (a concrete one is connected to, as in vLLM)
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://*:{replay}",
                "topic": "kv-events",
            }
            server = start_server("--served-model-name", "stories", "--kv-events-config", json.dumps(config))
            started.append((server, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))
        yield started
    finally:
        for server, _, _ in started:
            server.stop()


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory) -> Iterator[RouterProcess]:
    endpoints = [
        {"url": f"http://127.0.0.1:{server.port}", "kvEvents": events, "kvReplay": replay}
        for server, events, replay in engines
    ]
    folder = tmp_path_factory.mktemp("router")
    models = write_static_models(folder / "models.yaml", [{"name": "stories", "endpoints": endpoints}])
    with running_router("--static-models", str(models), "--load-interval", "0.2", log_path=folder / "log") as process:
        yield process


def _blocks(router: RouterProcess, server: Server) -> float:
    return router.metric("pagoda_router_kv_cached_blocks", endpoint=f"http://127.0.0.1:{server.port}")


def _wait(what: str, probe, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_token_prompt_goes_to_the_engine_whose_events_say_it_holds_the_prefix(router, engines) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 512) for _ in range(12 * BLOCK)]
    (first, _, _), (second, _, _) = engines
    # Sent straight to the second engine, behind the router's back: only its KV events can tell the router.
    status, _, _ = second.request("POST", "/v1/completions", {"model": "stories", "prompt": prefix, "max_tokens": 1})
    assert status == 200
    _wait("the router to learn the second engine's blocks", lambda: _blocks(router, second) >= 12)
    assert _blocks(router, first) == 0
    before = [s.metric("vllm:request_success_total") for s in (first, second)]
    for _ in range(4):
        prompt = prefix + [rng.randrange(3, 512) for _ in range(5)]
        status, _, reply = router.request(
            "POST", "/v1/completions", {"model": "stories", "prompt": prompt, "max_tokens": 1}
        )
        assert status == 200, reply
    time.sleep(0.3)
    gained = [s.metric("vllm:request_success_total") - b for s, b in zip((first, second), before)]
    assert gained == [0, 4], gained
    hits = second.metric("vllm:prefix_cache_hits_total")
    assert hits >= 4 * 12 * BLOCK  # each of the four was served from the cached prefix
