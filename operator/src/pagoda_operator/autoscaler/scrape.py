"""Read the three autoscaling gauges from an engine's Prometheus ``/metrics`` (a tiny text-format parser).

prometheus_client is not an operator dependency; only plain ``name{labels} value`` sample lines are needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import aiohttp

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE = "vllm:kv_cache_usage_perc"
SCRAPE_TIMEOUT_SECONDS = 2.0

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True, frozen=True)
class EngineMetrics:
    """The gauges of one pod; ``running`` and ``kv_cache_usage`` may be missing in older engines."""

    waiting: float
    running: Optional[float]
    kv_cache_usage: Optional[float]


def parse_metrics(text: str, model_name: Optional[str]) -> Optional[EngineMetrics]:
    """The gauges for ``model_name`` (series without that label count too); None when waiting is absent."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or match["name"] not in (WAITING, RUNNING, KV_CACHE):
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        if model_name is not None and labels.get("model_name", model_name) != model_name:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        # Several series of one gauge (per engine) add up for counts; usage takes the fullest.
        if match["name"] == KV_CACHE:
            values[KV_CACHE] = max(values.get(KV_CACHE, 0.0), value)
        else:
            values[match["name"]] = values.get(match["name"], 0.0) + value
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
