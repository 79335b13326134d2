"""The router's aiohttp application: OpenAI-compatible routes in front of every model of its ``ModelTable``.

A request's ``model`` (a served model name or a LoRA adapter name) selects the model; the picker chooses one of its
ready endpoints (prefix affinity against load) and ``proxy.forward`` streams the reply through. A known model with no
ready endpoint holds the request (``hold``) until one is ready or the hold timeout passes. ``GET /v1/models`` lists
every model and adapter; ``GET /health`` and ``GET /metrics`` (the router's own metrics) need no API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp
from aiohttp import web

from pagoda_operator.constants import KV_EVENTS_TOPIC
from pagoda_operator.router.endpoints import Endpoint
from pagoda_operator.router.hold import HoldFull, HoldQueues, HoldTimeout
from pagoda_operator.router.kv_index import KVIndex
from pagoda_operator.router.kv_subscriber import KVEventSubscriber
from pagoda_operator.router.load import LoadPoller
from pagoda_operator.router.metrics import RouterMetrics
from pagoda_operator.router.picker import Picker
from pagoda_operator.router.prefix import chunk_hashes, prompt_text
from pagoda_operator.router.proxy import Routed, Upstream, error_response, forward
from pagoda_operator.router.static_models import ModelTable

logger = logging.getLogger(__name__)

PROXIED_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
    "/tokenize",
    "/detokenize",
)
_OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key needed: probes and scrapers


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """What the application is configured with (``cli`` builds it from the command line)."""

    api_key: Optional[str] = None
    upstream_api_key: Optional[str] = None
    max_retries: int = 2
    connect_timeout: float = 5.0
    read_timeout: Optional[float] = None
    hold_timeout: float = 120.0
    max_held_requests: int = 256
    kv_events: bool = True
    load_interval: float = 1.0
    load_threshold: float = 8.0
    chunk_chars: int = 128


class Router:
    """The running router's state: the model table, the picker and its feeds, the hold queues, the metrics."""

    def __init__(
        self,
        table: ModelTable,
        options: RouterOptions,
        on_demand: Optional[Callable[[str], Awaitable[None]]] = None,
    ) -> None:
        self.table = table
        self.options = options
        self.metrics = RouterMetrics()
        self.kv_index = KVIndex()
        self.picker = Picker(
            chunk_chars=options.chunk_chars, load_threshold=options.load_threshold, kv_index=self.kv_index
        )
        self.hold = HoldQueues(
            max_held=options.max_held_requests,
            timeout=options.hold_timeout,
            metrics=self.metrics,
            on_demand=on_demand,
        )
        self.upstream: Optional[Upstream] = None
        self.poller: Optional[LoadPoller] = None
        self._known: dict[str, Endpoint] = {}
        self._subscribers: dict[str, tuple[KVEventSubscriber, asyncio.Task[None]]] = {}
        table.add_listener(self._on_change)

    def _on_change(self) -> None:
        """The table changed: follow its endpoints, and let held requests of models that have some go."""
        current = {e.key: e for e in self.table.endpoints()}
        for key in [k for k in self._known if k not in current or current[k] != self._known[k]]:
            self._stop_subscriber(key)
            if key not in current:
                self.picker.forget(key)
                self.kv_index.forget(key)  # a rollout's pods never come back under their names
        self._known = current
        if self.poller is not None:
            self.poller.set_endpoints(current.values())
            self._start_subscribers()
        for key, model in self.table.items():
            if model.endpoints and self.hold.held(key):
                self.hold.release(key)
        for key in list(self.hold.keys()):
            if self.table.get(key) is None:
                self.hold.release(key)  # the model is gone: its waiters answer 404

    def _start_subscribers(self) -> None:
        if not self.options.kv_events:
            return
        for key, endpoint in self._known.items():
            if endpoint.kv_events and key not in self._subscribers:
                subscriber = KVEventSubscriber(endpoint, self.kv_index, topic=KV_EVENTS_TOPIC)
                self._subscribers[key] = (subscriber, asyncio.create_task(subscriber.run()))

    def subscribed(self) -> list[str]:
        """The endpoints whose KV events this router follows."""
        return list(self._subscribers)

    def _stop_subscriber(self, key: str) -> None:
        entry = self._subscribers.pop(key, None)
        if entry is not None:
            entry[0].close()
            entry[1].cancel()
            self.kv_index.clear(key)

    async def start(self, session: aiohttp.ClientSession) -> asyncio.Task[None]:
        """Begin scraping loads and following KV events; the returned task is the load poller."""
        o = self.options
        self.upstream = Upstream(session, o.max_retries, o.connect_timeout, o.read_timeout, o.upstream_api_key)
        self.poller = LoadPoller(self.picker, session, interval=o.load_interval)
        self._on_change()
        return asyncio.create_task(self.poller.run())

    def stop(self) -> None:
        """Stop every KV events subscriber."""
        for key in list(self._subscribers):
            self._stop_subscriber(key)

    def reason(self, chosen: Endpoint, pool: Sequence[Endpoint], text: str, lora: Optional[str]) -> str:
        """Why ``chosen`` won: it held the longest prefix ("prefix"), was the least loaded of unequal loads
        ("load"), or neither decided and the spread hash did ("spread")."""
        hashes = chunk_hashes(text, self.picker.chunk_chars)
        if hashes and self.picker.match(chosen, hashes, lora=lora) > 0:
            return "prefix"
        loads = [self.picker.load_of(e.key, lora=lora) for e in pool]
        if len(set(loads)) > 1 and self.picker.load_of(chosen.key, lora=lora) == min(loads):
            return "load"
        return "spread"


def _token_like(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _token_ids(path: str, body: dict[str, Any]) -> Optional[tuple[int, ...]]:
    prompt = body.get("prompt") if path == "/v1/completions" else None
    # token ids an engine could hold (int64): anything else is the engine's to refuse, never the router's to crash on
    if isinstance(prompt, list) and prompt and all(_token_like(t) for t in prompt):
        return tuple(prompt)
    return None


def _bad_request(message: str) -> web.Response:
    return error_response(400, message, "invalid_request_error", "invalid_request")


def _requested_model(router: Router, body: dict[str, Any]) -> Optional[str]:
    name = body.get("model")
    if isinstance(name, str) and name:
        return name
    models = router.table.models()  # e.g. /tokenize without a model: fine while there is only one
    return models[0].name if name is None and len(models) == 1 else None


async def _route(request: web.Request, router: Router, path: str, name: str, raw: bytes, body: dict) -> Any:
    """Resolve ``name``, hold while its model has no endpoint, then forward."""
    received: float = request["pagoda_received"]
    while True:
        resolved = router.table.resolve(name)
        if resolved is None:
            message = f"The model `{name}` does not exist."
            return error_response(404, message, "invalid_request_error", "model_not_found")
        key, model, lora = resolved
        if model.endpoints:
            break
        try:
            await router.hold.wait(key, model.labels)
        except HoldFull:
            message = f"model {name!r} has no ready endpoint and {router.hold.max_held} requests already wait"
            return error_response(503, message, "service_unavailable", **{"Retry-After": "5"})
        except HoldTimeout:
            seconds = int(router.hold.timeout)
            message = f"model {name!r} had no ready endpoint within {seconds} s"
            return error_response(503, message, "service_unavailable", **{"Retry-After": "10"})
    text = prompt_text(path, body)
    routed = Routed(path, raw, text, name, lora, received, _token_ids(path, body))

    def candidates() -> Sequence[Endpoint]:
        current = router.table.get(key)
        return current.endpoints if current is not None else ()

    assert router.upstream is not None
    return await forward(
        request,
        routed,
        candidates,
        router.picker,
        router.upstream,
        router.metrics,
        lambda chosen, pool: router.reason(chosen, pool, text, lora),
    )


async def _proxy(request: web.Request) -> web.StreamResponse:
    router: Router = request.app["router"]
    request["pagoda_received"] = time.perf_counter()
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested deeper than Python's stack
        return _bad_request(f"the request body is not valid JSON: {error}")
    if not isinstance(body, dict):
        return _bad_request("the request body must be a JSON object")
    name = _requested_model(router, body)
    if name is None:
        return _bad_request("the request body needs `model`, a non-empty string")
    code = "499"  # the client went away before an answer
    try:
        reply = await _route(request, router, request.path, name, raw, body)
        code = str(reply.status)
        return reply
    finally:
        # Unknown names are one label value: clients must not grow the metric without bound.
        label = name if router.table.resolve(name) is not None else "unknown"
        router.metrics.requests.labels(label, code).inc()


async def _models(request: web.Request) -> web.Response:
    router: Router = request.app["router"]
    data: list[dict[str, Any]] = []
    seen: set[str] = set()
    for model in router.table.models():
        for name, parent in ((model.name, None), *((a, model.name) for a in model.adapters)):
            if name not in seen:
                seen.add(name)
                entry = {"id": name, "object": "model", "created": model.created, "owned_by": "pagoda"}
                data.append({**entry, "root": name, "parent": parent})
    return web.json_response({"object": "list", "data": data})


async def _health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _endpoints_state(request: web.Request) -> web.Response:
    """What the picker knows of each endpoint (in flight, last load, indexed chunks): for operators debugging a
    routing choice; behind the API key like every route but the probes."""
    return web.json_response(request.app["router"].picker.explain())


async def _metrics(request: web.Request) -> web.Response:
    router = request.app["router"]
    metrics: RouterMetrics = router.metrics
    metrics.observe_kv_blocks({key: router.kv_index.num_blocks(key) for key in router.subscribed()})
    return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})


@web.middleware
async def _errors_and_auth(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
    """OpenAI-format 401 without the router's key; OpenAI-format 404/405 for unknown paths and methods."""
    key = request.app["router"].options.api_key
    if key is not None and request.path not in _OPEN_PATHS:
        given = request.headers.get("Authorization", "")
        # surrogateescape: header bytes that are not UTF-8 compare (unequal) instead of raising
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {key}".encode()):
            return error_response(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error_response(404, f"no route for {request.method} {request.path}", "not_found_error", "not_found")
    except web.HTTPMethodNotAllowed:
        message = f"method {request.method} not allowed on {request.path}"
        return error_response(405, message, "invalid_request_error", "method_not_allowed")


def build_app(router: Router, background: Sequence[Callable[[], Awaitable[None]]] = ()) -> web.Application:
    """The application; ``background`` coroutines (discovery, a static file watch) run while it is up."""
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=64 * 1024**2)
    app["router"] = router
    for path in PROXIED_PATHS:
        app.router.add_post(path, _proxy)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/debug/endpoints", _endpoints_state)

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        # auto_decompress off: bytes pass through as the engine encoded them, with their Content-Encoding.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            tasks = [await router.start(session), *(asyncio.create_task(run()) for run in background)]
            yield
            router.stop()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    app.cleanup_ctx.append(lifetime)
    return app
