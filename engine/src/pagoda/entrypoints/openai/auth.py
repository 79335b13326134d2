"""API-key authentication as a pure ASGI middleware, so no route can be added around it by accident."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping, Sequence
from typing import Optional

from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda.entrypoints.openai.errors import OpenAIError

# Probes and the Prometheus scraper run without credentials in a cluster.
DEFAULT_EXEMPT_PATHS = frozenset({"/health", "/ready", "/metrics"})
API_KEY_ENV_VARS = ("PAGODA_API_KEY", "VLLM_API_KEY")

_MISSING_KEY_MESSAGE = (
    "You didn't provide an API key. Provide it in the Authorization header as 'Authorization: Bearer YOUR_KEY'."
)
# Deliberately says nothing about the key that was sent: keys must never reach logs or clients.
_WRONG_KEY_MESSAGE = "Incorrect API key provided."


def resolve_api_keys(cli_keys: Iterable[str], environ: Mapping[str, str]) -> list[str]:
    """The accepted keys: every ``--api-key`` value, then ``PAGODA_API_KEY`` and ``VLLM_API_KEY``.

    Each value is one whole key (no splitting on commas); surrounding whitespace and empty values are
    dropped, duplicates kept once.
    """
    candidates = [*cli_keys, *(environ.get(name, "") for name in API_KEY_ENV_VARS)]
    keys: list[str] = []
    for candidate in candidates:
        key = candidate.strip()
        if key and key not in keys:
            keys.append(key)
    return keys


def _bearer_token(scope: Scope) -> Optional[bytes]:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyMiddleware:
    """Rejects, with 401, every HTTP request outside ``exempt_paths`` that lacks a valid bearer key.

    With no keys configured every request passes. The token is compared against every key with
    ``hmac.compare_digest`` and without stopping at the first match, so the response time tells
    nothing about which key, or how much of one, matched.
    """

    def __init__(
        self, app: ASGIApp, api_keys: Sequence[str], exempt_paths: frozenset[str] = DEFAULT_EXEMPT_PATHS
    ) -> None:
        self.app = app
        self._keys = [key.encode() for key in api_keys if key]
        self.exempt_paths = frozenset(exempt_paths)

    def is_authorized(self, scope: Scope) -> bool:
        """Whether ``scope`` carries one of the keys (always true when no keys are configured)."""
        if not self._keys:
            return True
        token = _bearer_token(scope)
        matched = False
        for key in self._keys:
            # Compare even without a token so a missing header costs the same as a wrong one.
            matched |= hmac.compare_digest(token or b"", key)
        return matched and token is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        if self.is_authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        message = _WRONG_KEY_MESSAGE if _bearer_token(scope) is not None else _MISSING_KEY_MESSAGE
        error = OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)
