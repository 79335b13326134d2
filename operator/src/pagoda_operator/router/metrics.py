"""The router's own Prometheus metrics (``GET /metrics``), in a registry of their own.

- ``pagoda_router_requests_total{model, code}``: requests answered, by requested model name and HTTP status;
- ``pagoda_router_upstream_retries_total{model}``: requests sent again to another endpoint (connection failed, 503);
- ``pagoda_router_routing_decisions_total{reason}``: endpoints chosen, by why (the picker's reason: prefix, load,
  spread, ...);
- ``pagoda_router_added_latency_seconds``: the router's own share of a request's latency: from receiving it to
  sending it upstream, plus the delay between the first upstream byte and its write to the client;
- ``pagoda_router_held_requests{model_namespace, model_deployment}``: requests waiting for a model with no ready pod;
- ``pagoda_router_kv_cached_blocks{endpoint}``: the KV blocks each endpoint holds by its KV events (endpoints that
  publish them), as of the scrape.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagoda_operator.constants import ROUTER_HELD_METRIC

# Router overhead is sub-millisecond to a few milliseconds; buckets resolve that range.
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RouterMetrics:
    """The router's counters, histogram and gauge, and their text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagoda_router_requests", "Requests answered by the router", ["model", "code"], registry=self.registry
        )
        self.retries = Counter(
            "pagoda_router_upstream_retries",
            "Requests sent again to another endpoint before any byte reached the client",
            ["model"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "pagoda_router_routing_decisions", "Endpoints chosen, by reason", ["reason"], registry=self.registry
        )
        self.added_latency = Histogram(
            "pagoda_router_added_latency_seconds",
            "Router overhead: request received to sent upstream, plus first upstream byte to client",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.held = Gauge(
            ROUTER_HELD_METRIC,
            "Requests held for a model with no ready endpoint",
            ["model_namespace", "model_deployment"],
            registry=self.registry,
        )

        self.kv_blocks = Gauge(
            "pagoda_router_kv_cached_blocks",
            "KV cache blocks an endpoint holds, by its KV events",
            ["endpoint"],
            registry=self.registry,
        )

    def observe_kv_blocks(self, blocks: Mapping[str, int]) -> None:
        """Set the KV blocks gauge to ``blocks`` (endpoint key -> count), dropping endpoints no longer there."""
        self.kv_blocks.clear()
        for endpoint, count in blocks.items():
            self.kv_blocks.labels(endpoint).set(count)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
