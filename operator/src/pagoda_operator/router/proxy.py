"""Sending one request upstream and streaming the reply through, with retries on another endpoint.

The reply's bytes are written to the client as they arrive (Server-Sent Events pass through chunk by chunk), with
the upstream status and headers except hop-by-hop ones. A request is tried on another endpoint (never one tried
already), at most ``max_retries`` times, when the connection fails or the pod answers 503 (it is draining or not
ready) - always before any byte reached the client. A 429 is passed through: the pod is up and says so on purpose.
Once bytes were sent nothing is retried: a pod that dies mid-reply ends the client's stream. A client that goes away
cancels the handler, which closes the upstream connection, so the engine aborts the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from pagoda_operator.router.endpoints import Endpoint
from pagoda_operator.router.metrics import RouterMetrics
from pagoda_operator.router.picker import Picker

logger = logging.getLogger(__name__)

# RFC 9110 7.6.1 hop-by-hop headers, plus what aiohttp computes itself for the new message.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
# Not forwarded on a request: aiohttp answered the 100-continue already, and its server hands the body over decoded
# (forwarded as it is, it is not encoded any more).
_REQUEST_ONLY = frozenset({"expect", "content-encoding"})

_RETRIED_STATUSES = frozenset({503})


@dataclass(frozen=True, slots=True)
class Upstream:
    """How requests go upstream: the session, retries, and the Authorization to send (None: the client's)."""

    session: aiohttp.ClientSession
    max_retries: int = 2
    connect_timeout: float = 5.0
    read_timeout: Optional[float] = None  # longest silence between upstream bytes; None: no limit
    api_key: Optional[str] = None


@dataclass(frozen=True, slots=True)
class Routed:
    """What the server resolved for one request."""

    path: str
    body: bytes
    text: str  # the prompt text the picker weighs prefixes with
    model: str  # the requested name (metric label)
    lora: Optional[str]
    received: float
    token_ids: Optional[tuple[int, ...]] = (
        None  # a token-id prompt, matched against the engines' KV events  # time.perf_counter() when the request arrived
    )


def error_response(status: int, message: str, kind: str, code: Optional[str] = None, **headers: str) -> web.Response:
    """An OpenAI-format error: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code or kind}}
    return web.json_response(body, status=status, headers=headers or None)


def upstream_headers(incoming: Mapping[str, str], api_key: Optional[str]) -> CIMultiDict[str]:
    """The client's headers without hop-by-hop ones; Authorization replaced by the pod-side key when there is one."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lower = name.lower()
        if lower in _HOP_BY_HOP or lower in _REQUEST_ONLY or (api_key is not None and lower == "authorization"):
            continue
        out.add(name, value)
    if api_key is not None:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def _reply_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP)


class _Retry(Exception):
    """The endpoint failed before any byte reached the client: try another one."""


async def _stream_back(
    request: web.Request, upstream: aiohttp.ClientResponse, routed: Routed, sent_at: float, metrics: RouterMetrics
) -> web.StreamResponse:
    """Write the upstream reply to the client as it arrives."""
    reply = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=_reply_headers(upstream))
    if upstream.content_length is not None:
        reply.content_length = upstream.content_length
    try:
        async for chunk in upstream.content.iter_any():
            got = time.perf_counter()
            first = not reply.prepared
            if first:
                await reply.prepare(request)
            await reply.write(chunk)
            if first:
                metrics.added_latency.observe((sent_at - routed.received) + (time.perf_counter() - got))
    except (aiohttp.ClientError, TimeoutError) as error:
        if not reply.prepared:
            raise _Retry(repr(error)) from None
        if request.transport is None or request.transport.is_closing():
            logger.debug("client went away during a reply of %s", routed.model)
            return reply
        # Bytes went out: end the client's connection without the final chunk, so it sees a cut reply, not a
        # complete one.
        logger.warning("upstream reply for %s broke off: %s: %s", routed.model, type(error).__name__, error)
        request.transport.close()
        return reply
    if not reply.prepared:  # an empty body
        await reply.prepare(request)
        metrics.added_latency.observe(sent_at - routed.received)
    await reply.write_eof()
    return reply


async def _attempt(
    request: web.Request, endpoint: Endpoint, routed: Routed, upstream: Upstream, metrics: RouterMetrics
) -> Optional[web.StreamResponse]:
    """One try on ``endpoint``; None when it may be retried elsewhere (nothing reached the client)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=upstream.connect_timeout, sock_read=upstream.read_timeout)
    headers = upstream_headers(request.headers, upstream.api_key)
    url = (
        endpoint.url
        + routed.path
        + (f"?{request.rel_url.raw_query_string}" if request.rel_url.raw_query_string else "")
    )
    sent_at = time.perf_counter()
    try:
        # no Accept-Encoding of aiohttp's own: the reply passes through as the pod sends it, so only a client that
        # asked for compression (its header is forwarded) may get a compressed one
        reply = await upstream.session.request(
            request.method,
            url,
            data=routed.body,
            headers=headers,
            timeout=timeout,
            skip_auto_headers=("Accept-Encoding",),
        )
    except (aiohttp.ClientError, TimeoutError) as error:
        logger.warning("%s unreachable: %s: %s", endpoint.key, type(error).__name__, error)
        return None
    try:
        if reply.status in _RETRIED_STATUSES:
            logger.warning("%s answered %d; trying another endpoint", endpoint.key, reply.status)
            return None
        return await _stream_back(request, reply, routed, sent_at, metrics)
    except _Retry as error:
        logger.warning("%s broke off before its first byte: %s", endpoint.key, error)
        return None
    finally:
        if reply.content.is_eof():
            reply.release()  # read to the end: the connection can be reused
        else:
            reply.close()  # cut short (a 503, a client gone): drop it, so the engine aborts the request


async def forward(
    request: web.Request,
    routed: Routed,
    candidates: Callable[[], Sequence[Endpoint]],
    picker: Picker,
    upstream: Upstream,
    metrics: RouterMetrics,
    reason: Callable[[Endpoint, Sequence[Endpoint]], str],
) -> web.StreamResponse:
    """Pick an endpoint, send, and retry on another one as the module docstring says."""
    tried: list[str] = []
    for attempt in range(upstream.max_retries + 1):
        pool = [e for e in candidates() if e.key not in tried]
        endpoint = picker.pick(pool, routed.text, lora=routed.lora, token_ids=routed.token_ids)
        if endpoint is None:
            break
        metrics.decisions.labels(reason(endpoint, pool)).inc()  # before started(): it records the chunks
        if attempt:
            metrics.retries.labels(routed.model).inc()
        tried.append(endpoint.key)
        picker.started(endpoint, routed.text)
        try:
            logger.debug("%s %s -> %s (attempt %d)", routed.model, routed.path, endpoint.key, attempt + 1)
            reply = await _attempt(request, endpoint, routed, upstream, metrics)
        finally:
            picker.finished(endpoint)
        if reply is not None:
            return reply
    message = f"no endpoint of model {routed.model!r} could take the request (tried {len(tried)})"
    return error_response(503, message, "service_unavailable", **{"Retry-After": "1"})
