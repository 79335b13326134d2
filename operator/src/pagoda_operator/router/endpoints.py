"""What the router knows about the engines it sends requests to: where they are and how loaded they last were."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine pod (or static URL) that serves a model.

    ``key`` is the stable id ("namespace/podname" for pods, the URL for static endpoints); ``url`` has no trailing
    slash; ``kv_events`` / ``kv_replay`` are the pod's ZMQ publisher and replay addresses when it publishes KV events.
    """

    key: str
    url: str
    kv_events: Optional[str] = None
    kv_replay: Optional[str] = None


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """What the last scrape of an engine's ``GET /metrics`` said.

    ``waiting`` / ``running``: ``vllm:num_requests_waiting`` / ``_running``; ``kv_usage``: ``vllm:kv_cache_usage_perc``
    (0..1); ``loras``: the adapters ``vllm:lora_requests_info`` lists as running or waiting; ``block_size`` /
    ``num_blocks``: the labels of ``vllm:cache_config_info`` (None when not exposed); ``scraped_at``: time.monotonic().
    """

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    loras: frozenset[str] = frozenset()
    block_size: Optional[int] = None
    num_blocks: Optional[int] = None
    scraped_at: float = 0.0
