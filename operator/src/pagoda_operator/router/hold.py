"""The hold queue: requests for a known model with no ready endpoint wait here for one, in arrival order.

Each model has a bounded FIFO of waiters. ``release(key)`` (called when the model's endpoints change and it has
some) wakes them all, oldest first, so they are routed in the order they came. A waiter gives up after the hold
timeout. While a model has waiters, ``on_demand`` is called at most every ``stamp_interval`` seconds (the server
stamps the ModelDeployment's demand annotation with it, which the operator's autoscaler reads as a wish for a pod).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Optional

from pagoda_operator.constants import DEMAND_STAMP_INTERVAL_SECONDS
from pagoda_operator.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


class HoldFull(Exception):
    """The model's hold queue is at its bound; the request is refused at once."""


class HoldTimeout(Exception):
    """No endpoint became ready within the hold timeout."""


class HoldQueues:
    """Per-model FIFOs of requests waiting for a ready endpoint."""

    def __init__(
        self,
        *,
        max_held: int,
        timeout: float,
        metrics: Optional[RouterMetrics] = None,
        on_demand: Optional[Callable[[str], Awaitable[None]]] = None,
        stamp_interval: float = DEMAND_STAMP_INTERVAL_SECONDS,
    ) -> None:
        self.max_held = max_held
        self.timeout = timeout
        self._metrics = metrics
        self._on_demand = on_demand
        self._stamp_interval = stamp_interval
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}
        self._labels: dict[str, tuple[str, str]] = {}
        self._stamped: dict[str, float] = {}
        self._stamping: set[asyncio.Task[None]] = set()

    def held(self, key: str) -> int:
        """How many requests wait for the model under ``key``."""
        return len(self._waiters.get(key, ()))

    def keys(self) -> list[str]:
        """The models that have waiters."""
        return list(self._waiters)

    def release(self, key: str) -> None:
        """Wake every waiter of ``key``, oldest first (its model has a ready endpoint now)."""
        for future in self._waiters.pop(key, ()):
            if not future.done():
                future.set_result(None)
        self._update_gauge(key)

    def _update_gauge(self, key: str) -> None:
        if self._metrics is not None and key in self._labels:
            self._metrics.held.labels(*self._labels[key]).set(self.held(key))

    def _maybe_stamp(self, key: str) -> None:
        if self._on_demand is None:
            return
        now = time.monotonic()
        if now - self._stamped.get(key, -self._stamp_interval) < self._stamp_interval:
            return
        self._stamped[key] = now
        task = asyncio.create_task(self._stamp(key))
        self._stamping.add(task)  # a strong reference until it ends
        task.add_done_callback(self._stamping.discard)

    async def _stamp(self, key: str) -> None:
        assert self._on_demand is not None
        try:
            await self._on_demand(key)
        except Exception as error:  # a failed stamp must not fail the held request; it is tried again later
            logger.warning("could not record demand for %s: %s", key, error)
            self._stamped.pop(key, None)

    async def wait(self, key: str, labels: tuple[str, str]) -> None:
        """Wait until ``release(key)``; ``HoldFull`` when ``max_held`` already wait, ``HoldTimeout`` after the
        timeout. A cancelled waiter (client gone) leaves the queue."""
        queue = self._waiters.setdefault(key, deque())
        if len(queue) >= self.max_held:
            raise HoldFull(key)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(future)
        self._labels[key] = labels
        self._update_gauge(key)
        deadline = time.monotonic() + self.timeout
        try:
            while not future.done():
                self._maybe_stamp(key)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise HoldTimeout(key)
                # Wake at least every stamp interval, to renew the demand stamp while still holding.
                await asyncio.wait({future}, timeout=min(remaining, self._stamp_interval))
        finally:
            waiting = self._waiters.get(key)
            if waiting is not None and future in waiting:
                waiting.remove(future)
                if not waiting:
                    del self._waiters[key]
            self._update_gauge(key)
