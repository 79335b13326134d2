"""OpenAI-shaped error bodies and the FastAPI handlers that turn every failure into one.

Every error the server sends has the body ``{"error": {"message", "type", "param", "code"}}`` that the OpenAI
SDKs parse. Request validation failures are 400 (OpenAI's status), not FastAPI's default 422, and no handler
ever puts a traceback into a response.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from pagoda.entrypoints.openai.asgi import HTTPMiddleware

logger = logging.getLogger(__name__)

# Where FastAPI puts a request part in an error location; the client knows the field, not the part.
_REQUEST_PARTS = frozenset({"body", "query", "path", "header", "cookie"})
_INTERNAL_MESSAGE = "The server had an error while processing your request. The error was logged; please retry."


class OpenAIError(Exception):
    """An error to send to the client as an OpenAI error body with ``status_code``.

    ``code`` defaults to the status code (as vLLM does); ``headers`` are added to the response
    (``Retry-After`` on 429, for example).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Union[None, str, int] = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code: Union[str, int] = status_code if code is None else code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, dict[str, Any]]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as a response, headers included."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers or None)


def bad_request(message: str, param: Optional[str] = None) -> OpenAIError:
    """A 400 ``invalid_request_error`` naming the offending field."""
    return OpenAIError(400, message, param=param)


def not_found_model(name: str, available: Sequence[str]) -> OpenAIError:
    """404 for a request naming a model this server does not serve."""
    served = ", ".join(repr(a) for a in available) or "none"
    return OpenAIError(
        404,
        f"The model {name!r} does not exist. Models served here: {served}.",
        param="model",
        code="model_not_found",
    )


def too_many_requests(retry_after_s: float, why: Optional[str] = None) -> OpenAIError:
    """429 when the waiting queue (or ``why``: another bounded resource) is full; ``Retry-After`` is whole seconds
    (HTTP does not allow fractions)."""
    seconds = max(1, math.ceil(retry_after_s)) if math.isfinite(retry_after_s) else 1
    return OpenAIError(
        429,
        f"The server is overloaded: {why or 'too many requests are waiting'}. Retry after {seconds} s.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


def service_unavailable(message: str) -> OpenAIError:
    """503 while the model is loading or the server is draining."""
    return OpenAIError(503, message, type="service_unavailable_error", code="service_unavailable")


def internal_error(message: Optional[str] = None) -> OpenAIError:
    """500 with a message that names no internals (a generic one by default): the details stay in the log."""
    return OpenAIError(500, message or _INTERNAL_MESSAGE, type="internal_server_error")


_SAMPLING_PARAM_NAMES = frozenset(
    {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "logit_bias",
    }
)


def sampling_error(exc: ValueError) -> OpenAIError:
    """A 400 for a ``SamplingParams`` ValueError; its message starts with the field it is about."""
    message = str(exc)
    match = re.match(r"[a-z_]+", message)
    param = match.group(0) if match and match.group(0) in _SAMPLING_PARAM_NAMES else None
    return bad_request(message, param=param)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """A 400 for pydantic/FastAPI validation errors; ``param`` is the first error's dotted location."""
    if any(err.get("type") == "json_invalid" for err in errors):
        return bad_request("Invalid JSON body: the request body could not be parsed as JSON.")
    messages, params = [], []
    for err in errors:
        loc = [str(part) for part in err.get("loc", ())]
        if loc and loc[0] in _REQUEST_PARTS:
            loc = loc[1:]
        path = ".".join(loc)
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if not path:
            messages.append(msg if err.get("type") != "missing" else "The request body is missing.")
        else:
            messages.append(msg if msg.startswith(path) else f"{path}: {msg}")
        params.append(path or None)
    return bad_request("; ".join(messages) or "Invalid request.", param=params[0] if params else None)


async def _openai_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _request_validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, (RequestValidationError, ValidationError))
    return validation_error(exc.errors()).response()


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code in (404, 405):
        # The bare "Not Found" does not tell a client which URL it got wrong.
        detail = f"{detail}: {request.method} {request.url.path}"
    error_type = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
    error = OpenAIError(exc.status_code, detail, type=error_type, headers=exc.headers)
    return error.response()


async def _unhandled_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    request_id = request.scope.get("state", {}).get("request_id")
    logger.error("request_id=%s: unhandled error in %s %s", request_id, request.method, request.url.path, exc_info=exc)
    return internal_error().response()


class CatchAllMiddleware(HTTPMiddleware):
    """Turns an exception that escaped every handler into a 500 OpenAI body, logged with its traceback.

    Starlette's own last-resort handler re-raises after responding, which makes the ASGI server log the
    same traceback a second time; this middleware answers and stops the exception there. When the response
    has already started (a stream), nothing can be sent any more and the exception goes on to the server.
    """

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            if started:
                raise
            request_id = scope.get("state", {}).get("request_id")
            logger.error(
                "request_id=%s: unhandled error in %s %s",
                request_id,
                scope.get("method"),
                scope.get("path"),
                exc_info=exc,
            )
            await internal_error().response()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error ``app`` sends an OpenAI error body (call before the app starts serving)."""
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _request_validation_handler)
    app.add_exception_handler(ValidationError, _request_validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _unhandled_exception_handler)
    app.add_middleware(CatchAllMiddleware)
