"""HTTP hygiene around the OpenAI routes: read timeouts, a body size limit, and request ids.

- :class:`HeaderTimeoutH11Protocol`: uvicorn's h11 protocol, closing connections whose request head
  (request line and headers) has not fully arrived ``--http-header-timeout`` seconds after the connection
  opened or the previous response ended. Without it a client that sends half a request line holds its
  connection, and a task, forever. A head larger than h11's buffer limit (uvicorn's default, 16 KiB: a 1 MB
  header, 10,000 headers) is a 431, and one h11 cannot parse a 400, both OpenAI errors (uvicorn's own answer
  is a text/plain 400).
- :class:`BodyLimitMiddleware`: reads the whole request body before any route sees it, within
  ``--max-request-body-bytes`` (413) and ``--http-body-timeout`` seconds from the first read (408). Routes
  then parse a body that is known to be bounded. A body over the limit is never kept: it is read and
  dropped up to 8x the limit, so that a client still sending it can read the 413, and beyond that the
  connection is closed at once.
- :class:`RequestIdMiddleware`: takes ``X-Request-Id`` from the request (or makes one), echoes it on the
  response, and keeps it in ``current_request_id`` for log lines written while handling the request.
"""

from __future__ import annotations

import asyncio
import contextvars
import http
import json
import logging
import re
import uuid
from typing import Optional

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from pagoda.entrypoints.openai.asgi import HTTPMiddleware
from pagoda.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
_DISCARD_FACTOR = 8
# After refusing a malformed or oversized request head, what the client is still sending is read and dropped,
# up to this much and this long, before the connection closes: closing a socket with unread data resets the
# connection, and the reset can destroy the answer before the client reads it.
_LINGER_BYTES = 4 * 1024 * 1024
_LINGER_SECONDS = 2.0

# The id of the request being handled, for log records written while handling it.
current_request_id: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("request_id", default=None)


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's ``http`` protocol class, with this header timeout."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": header_timeout})


class HeaderTimeoutH11Protocol(H11Protocol):
    """h11 connections that must deliver each request head within ``header_timeout`` seconds."""

    header_timeout: float = 10.0
    _head_timer: Optional[asyncio.TimerHandle] = None
    _head_bytes = 0
    _head_tail = b""  # the last bytes of the head so far, to find an end of head split across reads
    _linger_bytes: Optional[int] = None  # bytes dropped since a refused head; None: not refused
    _linger_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._linger_bytes is not None:
            self._linger_bytes += len(data)
            if self._linger_bytes > _LINGER_BYTES:
                self.transport.close()
            return
        if self.conn.their_state is h11.IDLE:
            too_large = self._head_too_large(data)
            self._head_bytes += len(data)
            if too_large:
                self._refuse(431, f"the request line and headers are larger than {self._head_limit()} bytes")
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete: the body has its own timeout
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # the next request on this connection gets the same deadline

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this for a request head h11 refused: answer with an OpenAI error, then close."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # a response is under way: uvicorn's way
            super().send_400_response(msg)
        elif self._head_bytes > self._head_limit():  # h11 gave up on an incomplete head this large
            self._refuse(431, f"the request line and headers are larger than {self._head_limit()} bytes")
        else:
            self._refuse(400, "the request is not valid HTTP/1.1")

    def _head_limit(self) -> int:
        return self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the head, with ``data``, is over the limit. h11 only limits a head still incomplete after a
        read: one that arrives whole in a single read (10,000 headers in 110 kB) would be parsed at any size."""
        window = self._head_tail + data
        ends = [at for at in (window.find(b"\n\n"), window.find(b"\n\r\n")) if at >= 0]  # h11 takes both
        size = self._head_bytes - len(self._head_tail) + (min(ends) if ends else len(window))
        self._head_tail = window[-2:]
        return size > self._head_limit()

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with an OpenAI error, drop what the client still sends for a moment, then close."""
        code = "request_header_fields_too_large" if status == 431 else "invalid_http_request"
        self._disarm_head_timer()
        self.transport.write(_raw_response(status, message, code))
        self._linger_bytes = 0
        self._linger_timer = self.loop.call_later(_LINGER_SECONDS, self.transport.close)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_bytes = 0
        self._head_tail = b""
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._head_bytes:  # a partial request: say why before closing; an idle connection just closes
            logger.info(
                "closing a connection from %s: no complete request head in %.0f s", self.client, self.header_timeout
            )
            self.transport.write(_raw_response(408, "the request head did not arrive in time", "request_timeout"))
        self.transport.close()


class BodyLimitMiddleware(HTTPMiddleware):
    """Buffers each request body within a size limit and a deadline, then hands it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes
        self.timeout = timeout

    def applies_to(self, scope: Scope) -> bool:
        return scope["method"] not in _BODYLESS_METHODS

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = _content_length(scope)
        # An oversized body is still read (and dropped) up to this much, so the client, which is usually
        # still sending, can read the 413 instead of getting a reset connection. Beyond it: 413 and close.
        discard_limit = _DISCARD_FACTOR * self.max_bytes
        too_large = declared is not None and declared > self.max_bytes
        if declared is not None and declared > discard_limit:
            await self._too_large(declared, scope, receive, send, close=True)
            return
        body = bytearray()
        received = 0
        give_up = False  # too large to read even to drop it
        try:
            async with asyncio.timeout(self.timeout):  # one deadline for the whole body, not one per chunk
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client went away while sending: nobody to answer
                    chunk = message.get("body", b"")
                    received += len(chunk)
                    too_large = too_large or received > self.max_bytes
                    if too_large and received > discard_limit:
                        give_up = True
                        break
                    if not too_large:
                        body += chunk
                    more = message.get("more_body", False)
        except TimeoutError:
            logger.info("the request body did not arrive within %.0f s; answering 408", self.timeout)
            error = OpenAIError(408, "the request body did not arrive in time", code="request_timeout")
            await _closing(error)(scope, receive, send)
            return
        if give_up:
            await self._too_large(declared, scope, receive, send, close=True)
            return
        if too_large:
            await self._too_large(declared if declared is not None else received, scope, receive, send, close=False)
            return
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, size: Optional[int], scope: Scope, receive: Receive, send: Send, close: bool) -> None:
        what = f"is {size} bytes" if size is not None else "is larger than that"
        error = OpenAIError(
            413,
            f"the request body {what}; this server accepts at most {self.max_bytes} bytes (--max-request-body-bytes)",
            code="request_too_large",
        )
        await (_closing(error) if close else error.response())(scope, receive, send)


class RequestIdMiddleware(HTTPMiddleware):
    """``X-Request-Id`` in (or a new uuid), echoed out, in ``scope["state"]`` and in log records."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID_HEADER, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        token = current_request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


def request_id_of(scope: Scope) -> str:
    """The id :class:`RequestIdMiddleware` gave this request (a new one if it did not run)."""
    return scope.get("state", {}).get("request_id") or uuid.uuid4().hex


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:
            text = value.decode("latin-1").strip()
            if _VALID_REQUEST_ID.fullmatch(text):
                return text
            break  # unusable (too long, odd characters): make one rather than echo it
    return uuid.uuid4().hex


def _content_length(scope: Scope) -> Optional[int]:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then whatever comes next (a disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _closing(error: OpenAIError):
    """The error's response, closing the connection: the rest of the body is not worth reading."""
    error.headers["Connection"] = "close"
    return error.response()


def _raw_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error body, for answers written below the ASGI app."""
    body = json.dumps(OpenAIError(status, message, code=code).body()).encode()
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
