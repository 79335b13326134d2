"""Reading an engine's load from its /metrics, over real HTTP: a small aiohttp server on 127.0.0.1 serves
Prometheus text in vLLM's exposition (or fails, or stalls, on cue)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from pagoda_operator.router.endpoints import Endpoint
from pagoda_operator.router.load import LoadPoller, parse_metrics, scrape_load
from pagoda_operator.router.picker import Picker

pytestmark = [pytest.mark.timeout(60)]

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 2.0
# HELP vllm:num_requests_waiting_by_priority Number of requests waiting, by priority.
# TYPE vllm:num_requests_waiting_by_priority gauge
vllm:num_requests_waiting_by_priority{model_name="qwen",priority="0"} 40.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.25
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.7640e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="math"} 1.7649e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig.
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="2048"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="qwen"} 1234.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="qwen"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="qwen"} 2.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="qwen"} 2.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="qwen"} 0.9
"""
IDLE_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 0.0
"""


@dataclass
class MetricsServer:
    """Serves ``text`` at /metrics with ``status``, after ``delay`` seconds; counts the scrapes."""

    text: str = VLLM_METRICS
    status: int = 200
    delay: float = 0.0
    scrapes: int = 0
    url: str = ""
    runner: web.AppRunner | None = field(default=None, repr=False)

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(status=self.status, text=self.text, content_type="text/plain")

    async def start(self) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self


@pytest_asyncio.fixture
async def servers() -> AsyncIterator[list[MetricsServer]]:
    started = [await MetricsServer().start() for _ in range(2)]
    yield started
    for server in started:
        assert server.runner is not None
        await server.runner.cleanup()


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed again: connections are refused


@pytest.mark.asyncio
async def test_a_scrape_reads_queues_cache_adapters_and_capacity(
    servers: list[MetricsServer], session: aiohttp.ClientSession
) -> None:
    load = await scrape_load(session, servers[0].url)
    assert load is not None
    assert (load.running, load.waiting, load.kv_usage) == (3.0, 2.0, 0.25)  # not the by-priority gauge
    assert load.loras == {"sql", "chat", "math"}  # the newest series of lora_requests_info, running and waiting
    assert (load.block_size, load.num_blocks) == (16, 2048)
    assert abs(load.scraped_at - time.monotonic()) < 5


def test_several_engines_in_one_pod_add_their_queues_and_report_the_fullest_cache() -> None:
    text = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
"""
    load = parse_metrics(text)
    assert (load.running, load.waiting, load.kv_usage) == (5.0, 2.0, 0.7)
    assert load.loras == frozenset() and load.block_size is None and load.num_blocks is None


def test_a_cache_not_sized_yet_gives_no_capacity() -> None:
    load = parse_metrics('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n')
    assert (load.block_size, load.num_blocks) == (None, None)


@pytest.mark.parametrize("status, text", [(500, "oops"), (404, ""), (200, "this is {not prometheus\n")])
@pytest.mark.asyncio
async def test_an_error_or_unreadable_answer_is_an_unknown_load(
    servers: list[MetricsServer], session: aiohttp.ClientSession, status: int, text: str
) -> None:
    servers[0].status, servers[0].text = status, text
    assert await scrape_load(session, servers[0].url) is None


@pytest.mark.asyncio
async def test_a_refused_connection_is_an_unknown_load(session: aiohttp.ClientSession) -> None:
    assert await scrape_load(session, refused_url()) is None


@pytest.mark.asyncio
async def test_a_stalled_engine_is_given_up_on_at_the_timeout(
    servers: list[MetricsServer], session: aiohttp.ClientSession
) -> None:
    servers[0].delay = 5.0
    start = time.monotonic()
    assert await scrape_load(session, servers[0].url, timeout=0.3) is None
    assert time.monotonic() - start < 1.5


@pytest.mark.asyncio
async def test_the_poller_feeds_every_endpoint_concurrently_and_marks_failures_unknown(
    servers: list[MetricsServer], session: aiohttp.ClientSession
) -> None:
    picker = Picker()
    healthy, stalled = servers
    stalled.delay = 5.0
    healthy.text = IDLE_METRICS
    dead = Endpoint(key="ns/dead", url=refused_url())
    endpoints = [Endpoint(key="ns/a", url=healthy.url), Endpoint(key="ns/b", url=stalled.url), dead]
    poller = LoadPoller(picker, session, interval=0.1, timeout=0.5)
    poller.set_endpoints(endpoints)
    start = time.monotonic()
    await poller.poll_once()
    assert time.monotonic() - start < 1.5  # one timeout for the round, not one per endpoint
    report = picker.explain()
    assert report["ns/a"]["load"]["running"] == 0.0 and report["ns/a"]["load_known"]
    assert not report["ns/b"]["load_known"] and not report["ns/dead"]["load_known"]
    # an unknown endpoint counts as loaded: a new request goes to the one that answered
    assert picker.pick(endpoints, "hello") == endpoints[0]


@pytest.mark.asyncio
async def test_the_poller_keeps_polling_through_failures_and_forgets_removed_endpoints(
    servers: list[MetricsServer], session: aiohttp.ClientSession
) -> None:
    picker = Picker()
    first, second = servers
    second.status = 503
    poller = LoadPoller(picker, session, interval=0.05, timeout=0.5)
    poller.set_endpoints([Endpoint(key="ns/a", url=first.url), Endpoint(key="ns/b", url=second.url)])
    task = asyncio.create_task(poller.run())
    try:
        await asyncio.sleep(0.4)
        assert first.scrapes >= 3 and second.scrapes >= 3
        assert not task.done()
        assert picker.explain()["ns/b"]["load_known"] is False
        second.status = 200  # the engine recovers: the next rounds see it
        poller.set_endpoints([Endpoint(key="ns/b", url=second.url)])
        scraped = first.scrapes
        await asyncio.sleep(0.3)
        assert picker.explain()["ns/b"]["load_known"] is True
        assert first.scrapes <= scraped + 1  # a removed endpoint is no longer scraped
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_bad_poller_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        LoadPoller(Picker(), None, interval=0)  # type: ignore[arg-type]
