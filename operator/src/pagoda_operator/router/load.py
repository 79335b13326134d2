"""How loaded each engine is, from its Prometheus ``GET /metrics`` (vLLM's metric names, which Pagoda's engine keeps).

Read: ``vllm:num_requests_waiting`` and ``vllm:num_requests_running`` (summed over their series: an engine with
several data-parallel ranks or models exposes one per rank/model, and the pod's queue is their sum);
``vllm:kv_cache_usage_perc`` (the largest series: the pod is as constrained as its fullest cache);
``vllm:lora_requests_info`` (the series with the largest value, i.e. the newest: its value is the time it was set;
labels ``running_lora_adapters`` / ``waiting_lora_adapters``, comma-separated); ``vllm:cache_config_info`` (labels
``block_size`` / ``num_gpu_blocks`` of its first series that has them as integers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pagoda_operator.router.endpoints import Endpoint, EndpointLoad

if TYPE_CHECKING:
    from pagoda_operator.router.picker import Picker

log = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
# the engine's name (vLLM's since it renamed gpu_cache_usage_perc; tests/test_metric_names.py holds every name here
# to what the engine exports)
KV_USAGE = ("vllm:kv_cache_usage_perc",)
LORA_INFO = "vllm:lora_requests_info"
CACHE_CONFIG = "vllm:cache_config_info"


def _int_label(labels: dict[str, str], name: str) -> Optional[int]:
    try:
        value = int(labels.get(name, ""))
    except ValueError:  # absent, or "None" before the engine sized its cache
        return None
    return value if value > 0 else None


def _adapters(labels: dict[str, str]) -> frozenset[str]:
    names = ",".join((labels.get("running_lora_adapters", ""), labels.get("waiting_lora_adapters", "")))
    return frozenset(name.strip() for name in names.split(",") if name.strip())


def parse_metrics(text: str, scraped_at: Optional[float] = None) -> EndpointLoad:
    """The load an engine's Prometheus exposition describes; raises ValueError on text that is not Prometheus's."""
    waiting = running = kv_usage = 0.0
    loras: frozenset[str] = frozenset()
    lora_stamp = float("-inf")
    block_size = num_blocks = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == WAITING:
                waiting += sample.value
            elif sample.name == RUNNING:
                running += sample.value
            elif sample.name in KV_USAGE:
                kv_usage = max(kv_usage, sample.value)
            elif sample.name == LORA_INFO and sample.value > lora_stamp:
                lora_stamp, loras = sample.value, _adapters(sample.labels)
            elif sample.name == CACHE_CONFIG and block_size is None:
                size, blocks = _int_label(sample.labels, "block_size"), _int_label(sample.labels, "num_gpu_blocks")
                if size is not None and blocks is not None:
                    block_size, num_blocks = size, blocks
    return EndpointLoad(
        waiting=waiting,
        running=running,
        kv_usage=kv_usage,
        loras=loras,
        block_size=block_size,
        num_blocks=num_blocks,
        scraped_at=time.monotonic() if scraped_at is None else scraped_at,
    )


async def scrape_load(session: aiohttp.ClientSession, url: str, timeout: float = 2.0) -> Optional[EndpointLoad]:
    """GET ``{url}/metrics`` and parse it; None when the engine does not answer 200 within ``timeout`` seconds or
    answers something that is not Prometheus text (its load is then unknown). Never raises but for cancellation."""
    try:
        # identity: the router's session does not decompress (it passes replies through), and prometheus_client
        # gzips /metrics for a client that accepts it
        headers = {"Accept-Encoding": "identity"}
        timeout_s = aiohttp.ClientTimeout(total=timeout)
        async with session.get(f"{url}/metrics", timeout=timeout_s, headers=headers) as response:
            if response.status != 200:
                log.debug("scrape of %s: HTTP %s", url, response.status)
                return None
            text = await response.text()
    except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError) as error:
        log.debug("scrape of %s failed: %r", url, error)
        return None
    try:
        return parse_metrics(text)
    except Exception as error:  # the parser raises ValueError, and odd lines may raise others: unknown, not fatal
        log.debug("metrics of %s do not parse: %r", url, error)
        return None


class LoadPoller:
    """Scrapes every endpoint's /metrics every ``interval`` seconds (all at once, each within ``timeout``) and feeds
    ``Picker.update_load``: the load, or None when the scrape failed."""

    def __init__(
        self, picker: Picker, session: aiohttp.ClientSession, interval: float = 1.0, *, timeout: float = 2.0
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be positive")
        self.picker = picker
        self.session = session
        self.interval = interval
        self.timeout = timeout
        self._endpoints: dict[str, Endpoint] = {}

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """The endpoints to scrape from the next round on."""
        self._endpoints = {endpoint.key: endpoint for endpoint in endpoints}

    async def poll_once(self) -> None:
        """One round: scrape every endpoint concurrently and report each result (a removed endpoint's is dropped)."""
        endpoints = list(self._endpoints.values())
        results = await asyncio.gather(
            *(scrape_load(self.session, endpoint.url, self.timeout) for endpoint in endpoints), return_exceptions=True
        )
        for endpoint, result in zip(endpoints, results, strict=True):
            if self._endpoints.get(endpoint.key) != endpoint:
                continue  # removed (or moved) while it was scraped
            if isinstance(result, asyncio.CancelledError):
                raise result
            self.picker.update_load(endpoint.key, result if isinstance(result, EndpointLoad) else None)

    async def run(self) -> None:
        """Poll until cancelled; a failing round is logged, never raised."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # the router keeps routing on the last loads; the next round tries again
                log.exception("load polling round failed")
            await asyncio.sleep(max(self.interval - (loop.time() - started), 0.0))
