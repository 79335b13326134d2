"""Read the three autoscaling gauges from an engine's Prometheus ``/metrics`` with prometheus_client's parser."""

from __future__ import annotations

from typing import Optional

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pagoda_operator.autoscaler.algorithm import EngineMetrics

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE = "vllm:kv_cache_usage_perc"
SCRAPE_TIMEOUT_SECONDS = 2.0


def parse_metrics(text: str, model_name: Optional[str]) -> Optional[EngineMetrics]:
    """The gauges for ``model_name`` (series without that label count too); None when waiting is absent or the
    exposition does not parse."""
    values: dict[str, float] = {}
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError:  # not Prometheus text: unknown, like a failed scrape
        return None
    for sample in samples:
        if sample.name not in (WAITING, RUNNING, KV_CACHE):
            continue
        if model_name is not None and sample.labels.get("model_name", model_name) != model_name:
            continue
        # Several series of one gauge (per engine) add up for counts; usage takes the fullest.
        if sample.name == KV_CACHE:
            values[KV_CACHE] = max(values.get(KV_CACHE, 0.0), sample.value)
        else:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    if WAITING not in values:
        return None
    return EngineMetrics(values[WAITING], values.get(RUNNING), values.get(KV_CACHE))


async def scrape(
    session: aiohttp.ClientSession, url: str, model_name: Optional[str], timeout: float = SCRAPE_TIMEOUT_SECONDS
) -> Optional[EngineMetrics]:
    """GET ``url`` and parse it; any failure (refused, timeout, HTTP error, no metric) is None: unknown."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                return None
            return parse_metrics(await response.text(), model_name)
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None
