"""A tiny real HTTP upstream for the router tests (aiohttp in a thread): it records what reaches it and answers as told.

Modes: ``ok`` (a completion-shaped JSON reply, or Server-Sent Events when the body asks ``stream``; a stream waits on
``gate`` between its first and second event), ``503`` (draining), ``drop`` (closes the connection without a reply), ``cut`` (sends the first event of a stream,
then closes the connection).
``GET /metrics`` answers an empty exposition, so the router's load scrapes succeed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class StandInUpstream:
    mode: str = "ok"
    name: str = "stand-in"
    seen: list[Seen] = field(default_factory=list)
    scrapes: int = 0
    port: int = 0
    stream_closed: threading.Event = field(default_factory=threading.Event)  # a stream's client went away
    _loop: Optional[asyncio.AbstractEventLoop] = None
    _runner: Optional[web.AppRunner] = None
    _gate: Optional[asyncio.Event] = None
    _thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open_gate(self) -> None:
        assert self._loop is not None and self._gate is not None
        self._loop.call_soon_threadsafe(self._gate.set)

    async def _metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(text="", content_type="text/plain")

    async def _post(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.seen.append(Seen(request.path, dict(request.headers), body))
        if self.mode == "503":
            return web.json_response({"error": {"message": "draining"}}, status=503)
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if self.mode == "cut":
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            await reply.write(b'data: {"n": 1}\n\n')
            assert request.transport is not None
            request.transport.close()
            return reply
        if isinstance(body, dict) and body.get("stream"):
            return await self._stream(request)
        reply = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": body.get("model") if isinstance(body, dict) else None,
            "choices": [{"index": 0, "text": f"from {self.name}", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
        return web.json_response(reply)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        assert self._gate is not None
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        try:
            await reply.write(b'data: {"n": 1}\n\n')
            await self._gate.wait()
            await reply.write(b'data: {"n": 2}\n\ndata: [DONE]\n\n')
            await reply.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.stream_closed.set()
            raise
        finally:
            if request.transport is None or request.transport.is_closing():
                self.stream_closed.set()
        return reply

    def start(self) -> StandInUpstream:
        started = threading.Event()

        async def main() -> None:
            self._gate = asyncio.Event()
            app = web.Application()
            app.router.add_get("/metrics", self._metrics)
            app.router.add_route("POST", "/{tail:.*}", self._post)
            self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            started.set()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(main(), self._loop).result(10)
        started.wait(10)
        return self

    def stop(self) -> None:
        """Close the port (later connections are refused) and end the thread."""
        if self._loop is None:
            return
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop = None
