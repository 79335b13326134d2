"""A TCP proxy on loopback that can be told to hold back what the server sends: a slow or hung API server, for the
leader election tests. It forwards bytes (TLS passes through untouched), so clients keep verifying the real server
certificate; they only need the proxy's address in place of the server's."""

from __future__ import annotations

import asyncio
import contextlib


class SlowProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream``; while ``delay`` > 0, each chunk the server sends waits that
    many seconds before it reaches the client (requests still go through at once)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay = 0.0
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> SlowProxy:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        """Stop listening and cut every connection, held-back data included."""
        assert self._server is not None
        self._server.close()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await self._server.wait_closed()

    async def _connect(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        server_in, server_out = await asyncio.open_connection(*self.upstream)
        for pump in (self._pump(client_in, server_out, slow=False), self._pump(server_in, client_out, slow=True)):
            task = asyncio.create_task(pump)
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, slow: bool) -> None:
        try:
            while chunk := await source.read(65536):
                if slow and self.delay > 0:
                    await asyncio.sleep(self.delay)
                sink.write(chunk)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.close()
            with contextlib.suppress(Exception):
                await sink.wait_closed()
