"""The Responses API's in-memory store: what ``GET /v1/responses/{id}`` answers and ``previous_response_id``
continues from.

A stored response keeps its response object and the conversation it ends (the chat messages of its input,
without its ``instructions``, and its output as an assistant turn), so that a request naming it as
``previous_response_id`` is rendered with that conversation first. The store is bounded by count
(``--max-stored-responses``) and by bytes (``MAX_STORED_BYTES``); the least recently used response goes first.
It lives in the server process: a restart, or another replica, does not know the ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from pagoda.entrypoints.openai.errors import OpenAIError, bad_request

MAX_STORED_BYTES = 64 * 1024 * 1024
T = TypeVar("T")


@dataclass(slots=True)
class StoredResponse:
    """One response: its object (``status`` ``in_progress`` until it ends), its conversation, and the event that
    cancels it while it runs."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    abort: Optional[Callable[[], None]] = None  # aborts its engine request (whether or not its client reads)
    size: int = 0


def not_found(response_id: str, param: Optional[str] = None) -> OpenAIError:
    """404 for an id that is not (or no longer) stored."""
    return OpenAIError(
        404,
        f"Response with id {response_id!r} not found (never stored, evicted, or deleted).",
        param=param,
        code="response_not_found",
    )


class ResponseStore:
    """Stored responses by id, least recently used first."""

    def __init__(self, max_responses: int, max_bytes: int = MAX_STORED_BYTES) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("--max-stored-responses must be at least 1")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, body: dict[str, Any]) -> StoredResponse:
        """Store a response that has just started (``status`` ``in_progress``)."""
        entry = StoredResponse(body)
        self._put(body["id"], entry)
        return entry

    def finish(self, entry: StoredResponse, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """The response has ended: keep its final object and conversation (if it is still stored)."""
        entry.body, entry.conversation = body, conversation
        entry.done.set()
        if self._entries.get(body["id"]) is entry:
            self._put(body["id"], entry)

    def get(self, response_id: str, param: Optional[str] = None) -> StoredResponse:
        """The stored response (now the most recently used); 404 if there is none."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            raise not_found(response_id)
        self._bytes -= entry.size
        if not entry.done.is_set():  # a deleted response that is still running stops
            entry.cancelled.set()
            if entry.abort is not None:
                entry.abort()

    async def cancel(self, response_id: str, wait: float = 1.0) -> dict[str, Any]:
        """Stop a response that is still running and answer its object once it has stopped; 400 for one that
        has ended already."""
        entry = self.get(response_id)
        if entry.done.is_set():
            status = entry.body.get("status")
            raise bad_request(f"response {response_id!r} is {status}; only an in-progress response can be cancelled")
        entry.cancelled.set()
        if entry.abort is not None:
            entry.abort()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(entry.done.wait(), wait)
        if not entry.done.is_set():  # its stream is stalled on a client that does not read: it ends when it reads
            entry.body = {**entry.body, "status": "cancelled"}
        return entry.body

    def _put(self, response_id: str, entry: StoredResponse) -> None:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self._bytes -= old.size
        entry.size = len(json.dumps([entry.body, entry.conversation], default=str))
        if entry.size > self.max_bytes:
            return  # too large to keep at all
        self._entries[response_id] = entry
        self._bytes += entry.size
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size


async def until_cancelled(items: AsyncIterator[T], cancelled: asyncio.Event) -> AsyncIterator[T]:
    """``items`` until they end or ``cancelled`` is set; then the source is closed (which aborts its request)."""
    iterator = items.__aiter__()
    waiter = asyncio.ensure_future(cancelled.wait())
    try:
        while not cancelled.is_set():
            step = asyncio.ensure_future(iterator.__anext__())
            await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                return
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        waiter.cancel()
        closer = getattr(iterator, "aclose", None)
        if closer is not None:
            await closer()
