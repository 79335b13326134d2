"""What ``GET /openapi.json`` documents: the response bodies and every status code a route can return.

FastAPI documents request bodies from the pydantic models by itself, but it would also document a 422
the server never sends (validation errors are 400, as OpenAI's) and know nothing of the 4xx/5xx bodies,
the Server-Sent Events of ``stream: true`` or the plain-text ``/metrics``. The models here are the response
shapes, and ``route_responses`` the per-route status codes; a schemathesis run in the test suite holds the
document and the server to each other.
"""

from __future__ import annotations

from typing import Any, Generic, Optional, TypeVar, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, create_model
from pydantic.json_schema import models_json_schema

from pagoda.entrypoints.openai.responses import SSE_MEDIA_TYPE


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[None, str, int] = None


class ErrorResponse(BaseModel):
    """Every error body: OpenAI's shape."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class _ResponseHead(BaseModel):
    """The fields every completion and chat body, whole or streamed, opens with."""

    id: str
    object: str
    created: int
    model: str


_ChoiceT = TypeVar("_ChoiceT", bound=BaseModel)


class _WholeResponse(_ResponseHead, Generic[_ChoiceT]):
    """A response without ``stream``: every choice, then the usage."""

    choices: list[_ChoiceT]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


def _choice(name: str, output_field: str, output: type, logprobs: type[BaseModel]) -> type[BaseModel]:
    """A whole choice: its index, its output (``text`` or ``message``), its logprobs and why it ended, in that order
    (a shared base class would list its own fields first)."""
    fields: dict[str, Any] = {
        "index": (int, ...),
        output_field: (output, ...),
        "logprobs": (Optional[logprobs], None),
        "finish_reason": (Optional[str], None),
        "stop_reason": (Union[None, int, str], None),
    }
    return create_model(name, __module__=__name__, **fields)


CompletionChoice = _choice("CompletionChoice", "text", str, CompletionLogprobs)


class Completion(_WholeResponse[CompletionChoice]):
    """``POST /v1/completions`` without ``stream``."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(BaseModel):
    id: str
    type: str  # "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: str
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # with --reasoning-parser
    tool_calls: Optional[list[ToolCall]] = None


ChatChoice = _choice("ChatChoice", "message", AssistantMessage, ChatLogprobs)


class ChatCompletion(_WholeResponse[ChatChoice]):
    """``POST /v1/chat/completions`` without ``stream``."""


class CompletionChunk(_ResponseHead):
    """One event of ``POST /v1/completions`` with ``stream: true`` (the usage chunk has no choices)."""

    choices: list[CompletionChoice]  # the same shape as in a whole response, with this step's text
    usage: Optional[Usage] = None


class ToolCallFunctionDelta(BaseModel):
    name: Optional[str] = None  # in a call's first fragment
    arguments: str = ""  # fragments of the arguments' JSON text, to be concatenated


class ToolCallDelta(BaseModel):
    index: int
    id: Optional[str] = None  # in a call's first fragment
    type: Optional[str] = None
    function: ToolCallFunctionDelta


class ChatDelta(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(_ResponseHead):
    """One event of ``POST /v1/chat/completions`` with ``stream: true``."""

    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


class ResponseObject(BaseModel):
    """``POST /v1/responses`` without ``stream``, and ``GET /v1/responses/{response_id}``."""

    id: str
    object: str  # "response"
    created_at: int
    model: str
    status: str
    output: list[dict[str, Any]]
    usage: Optional[dict[str, Any]] = None


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class StatusResponse(BaseModel):
    status: str


class VersionResponse(BaseModel):
    version: str


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


_AUTH = {401: _error("Missing or wrong API key (when the server has one)")}
_BODY = {
    400: _error("Invalid request: the message and `param` name the field"),
    408: _error("The request body did not arrive within --http-body-timeout"),
    413: _error("The request body is larger than --max-request-body-bytes"),
}
_TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Done"}
_ENGINE = {
    404: _error("The `model` is not served here"),
    500: _error("This request failed on the server (the engine carries on)"),
    503: _error("The model is loading, the server is draining, or the engine stopped"),
}
_RESPONSE_EVENTS = {
    "content": {SSE_MEDIA_TYPE: {"schema": {"type": "string"}}},
    "description": "A response object, or with `stream: true` Server-Sent Events of the Responses API",
}
_STREAMING = {
    "content": {SSE_MEDIA_TYPE: {"schema": {"type": "string"}}},
    "description": "A JSON body, or with `stream: true` Server-Sent Events of chunks ending in `data: [DONE]`",
}


def route_responses(route: str) -> dict[Union[int, str], dict[str, Any]]:
    """The ``responses`` argument of each route: every status code it can answer with, and the body."""
    generation = {**_AUTH, **_BODY, **_ENGINE, 429: _error("Too many requests are waiting; see Retry-After")}
    stored = {**_AUTH, **_ENGINE, 400: _error("Not in progress"), 404: _error("No stored response of that id")}
    table: dict[str, dict[Union[int, str], dict[str, Any]]] = {
        "/v1/completions": {200: {"model": Completion, **_STREAMING}, **generation},
        "/v1/chat/completions": {200: {"model": ChatCompletion, **_STREAMING}, **generation},
        "/tokenize": {200: {"model": TokenizeResponse}, **_AUTH, **_BODY, **_ENGINE},
        "/detokenize": {200: {"model": DetokenizeResponse}, **_AUTH, **_BODY, **_ENGINE},
        "/v1/responses": {200: {"model": ResponseObject, **_RESPONSE_EVENTS}, **generation},
        # GET (the stored response), DELETE, and POST .../cancel (400: it is not in progress)
        "/v1/responses/{response_id}": {200: {"description": "The stored response, or its deletion"}, **stored},
        "/v1/responses/{response_id}/cancel": {200: {"model": ResponseObject}, **stored},
        "/v1/models": {200: {"model": ModelList}, **_AUTH},
        "/version": {200: {"model": VersionResponse}, **_AUTH},
        "/health": {200: {"model": StatusResponse}, 503: _error("The model failed to load or the engine stopped")},
        "/ready": {200: {"model": StatusResponse}, 503: {"model": StatusResponse, "description": "Not ready"}},
        "/metrics": {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}},
        "/lora_adapters": {
            200: {"description": "Every LoRA adapter of the server and its state"},
            503: _error("LoRA is on and the model (with the adapter list) is still loading"),
        },
        "/v1/load_lora_adapter": {
            200: _TEXT,
            **_AUTH,
            **_BODY,
            **_ENGINE,
            400: _error("The adapter cannot be served (the message names the field), or the name is taken"),
        },
        "/v1/unload_lora_adapter": {200: _TEXT, **_AUTH, **_BODY, **_ENGINE, 404: _error("No adapter of that name")},
    }
    return table[route]


_STREAMED = {"/v1/completions": CompletionChunk, "/v1/chat/completions": ChatCompletionChunk}
_REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI) -> None:
    """Serve a document without FastAPI's automatic 422 (the server answers validation errors with 400),
    and with each Server-Sent Event described: ``data`` is a JSON chunk, an error body, or ``[DONE]``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            models = [(model, "serialization") for model in (*_STREAMED.values(), ErrorResponse)]
            _, definitions = models_json_schema(models, ref_template=_REF)
            components.update(definitions.get("$defs", {}))
            for path, chunk in _STREAMED.items():
                content = schema["paths"][path]["post"]["responses"]["200"]["content"]
                content[SSE_MEDIA_TYPE] = {"schema": _sse_event_schema(chunk.__name__)}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _sse_event_schema(chunk: str) -> dict[str, Any]:
    """One event as Open API 3.1 reads ``text/event-stream``: its ``data`` field, holding JSON or ``[DONE]``."""
    payload = {"anyOf": [{"$ref": _REF.format(model=chunk)}, {"$ref": _REF.format(model="ErrorResponse")}]}
    data = {
        "anyOf": [
            {"type": "string", "const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]
    }
    return {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}
