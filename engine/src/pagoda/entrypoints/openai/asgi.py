"""The shape the server's own ASGI middlewares share: they act on HTTP requests and let every other scope
(lifespan, websockets) through to the app untouched."""

from __future__ import annotations

from abc import ABC, abstractmethod

from starlette.types import ASGIApp, Receive, Scope, Send


class HTTPMiddleware(ABC):
    """A pure ASGI middleware for HTTP requests; :meth:`handle` sees each request :meth:`applies_to` accepts."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.applies_to(scope):
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    def applies_to(self, scope: Scope) -> bool:
        """Whether this HTTP request goes through :meth:`handle` (each one, unless a subclass says otherwise)."""
        return True

    @abstractmethod
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one HTTP request, calling ``self.app`` to pass it on."""
