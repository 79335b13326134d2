"""The server's error bodies and API-key middleware, driven through a tiny FastAPI app.

httpx (and so starlette's TestClient) is not installed, so requests go straight into the ASGI app
through ``call`` below, exactly as an ASGI server would deliver them.
"""

import asyncio
import hmac
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import pytest
from fastapi import FastAPI

from pagoda.entrypoints.openai.auth import ApiKeyMiddleware, resolve_api_keys
from pagoda.entrypoints.openai.errors import (
    OpenAIError,
    install_error_handlers,
    not_found_model,
    service_unavailable,
    too_many_requests,
)
from pagoda.entrypoints.openai.protocol import CompletionRequest


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    app: Any, method: str, path: str, body: Optional[bytes] = None, headers: Sequence[tuple[str, str]] = ()
) -> Response:
    """One HTTP request through the ASGI app; returns what it sent back."""
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers]
    if body is not None:
        raw_headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw_headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict[str, Any]] = []
    request_messages = [{"type": "http.request", "body": body or b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return request_messages.pop(0) if request_messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Response(start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, content)


def assert_openai_error(response: Response, status: int, param: Optional[str] = None) -> dict[str, Any]:
    assert response.status == status, response.body
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    assert body["error"]["message"]
    return body["error"]


def build_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> dict[str, Any]:
        params = request.to_sampling_params(None, {})
        return {"prompts": request.prompts(), "temperature": params.temperature}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": []}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret-internal-detail")

    @app.get("/busy")
    async def busy() -> None:
        raise too_many_requests(2.3)

    @app.get("/missing-model")
    async def missing_model() -> None:
        raise not_found_model("gpt-4", ["stories260K"])

    @app.get("/draining")
    async def draining() -> None:
        raise service_unavailable("The server is shutting down.")

    for path in ("/health", "/ready", "/metrics"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET"])
    return app


@pytest.fixture(scope="module")
def app() -> FastAPI:
    return build_app()


def post_json(app: Any, path: str, payload: Any, headers: Sequence[tuple[str, str]] = ()) -> Response:
    return call(app, "POST", path, json.dumps(payload).encode(), headers)


# --- errors --------------------------------------------------------------------------------------------------


def test_valid_request_passes_through(app: FastAPI) -> None:
    response = post_json(app, "/v1/completions", {"prompt": [1, 2, 3], "temperature": 0})
    assert response.status == 200
    assert response.json() == {"prompts": [[1, 2, 3]], "temperature": 0.0}


def test_wrong_type_is_400_naming_the_field(app: FastAPI) -> None:
    error = assert_openai_error(
        post_json(app, "/v1/completions", {"prompt": "hi", "temperature": "hot"}), 400, "temperature"
    )
    assert error["type"] == "invalid_request_error"
    assert error["code"] == 400
    assert error["message"].startswith("temperature: ")


def test_missing_required_field_is_400_naming_it(app: FastAPI) -> None:
    assert_openai_error(post_json(app, "/v1/completions", {"max_tokens": 4}), 400, "prompt")


def test_max_tokens_below_one_is_400_naming_it(app: FastAPI) -> None:
    assert_openai_error(post_json(app, "/v1/completions", {"prompt": "a", "max_tokens": 0}), 400, "max_tokens")


def test_out_of_bounds_value_is_400_naming_the_field(app: FastAPI) -> None:
    error = assert_openai_error(
        post_json(app, "/v1/completions", {"prompt": "a", "temperature": -1}), 400, "temperature"
    )
    assert "greater than or equal to 0" in error["message"]


def test_sampling_params_rejection_is_400_naming_the_field(app: FastAPI) -> None:
    # a rule between two fields, which only SamplingParams checks
    error = assert_openai_error(
        post_json(app, "/v1/completions", {"prompt": "a", "min_tokens": 10, "max_tokens": 5}), 400, "min_tokens"
    )
    assert "must not exceed max_tokens" in error["message"]


def test_unsupported_feature_is_400_with_its_message(app: FastAPI) -> None:
    error = assert_openai_error(post_json(app, "/v1/completions", {"prompt": "a", "suffix": "z"}), 400, "suffix")
    assert error["message"] == "suffix is not supported"


def test_malformed_json_is_400(app: FastAPI) -> None:
    error = assert_openai_error(call(app, "POST", "/v1/completions", b'{"prompt": "a",'), 400)
    assert "Invalid JSON" in error["message"]


def test_body_that_is_not_an_object_is_400(app: FastAPI) -> None:
    assert call(app, "POST", "/v1/completions", b"[1, 2]").status == 400


def test_unknown_route_is_404_openai_body(app: FastAPI) -> None:
    error = assert_openai_error(call(app, "GET", "/v1/nothing-here"), 404)
    assert "/v1/nothing-here" in error["message"]


def test_wrong_method_is_405_openai_body_with_allow(app: FastAPI) -> None:
    response = call(app, "POST", "/v1/models", b"{}")
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "GET"


def test_unhandled_exception_is_500_without_details_but_logged(app: FastAPI, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="pagoda.entrypoints.openai.errors"):
        response = call(app, "GET", "/boom")
    error = assert_openai_error(response, 500)
    assert error["type"] == "internal_server_error"
    assert b"secret-internal-detail" not in response.body
    assert b"Traceback" not in response.body and b"RuntimeError" not in response.body
    logged = [r for r in caplog.records if r.exc_info]
    assert logged and "secret-internal-detail" in str(logged[0].exc_info[1])


def test_too_many_requests_is_429_with_whole_second_retry_after(app: FastAPI) -> None:
    response = call(app, "GET", "/busy")
    error = assert_openai_error(response, 429)
    assert response.headers["retry-after"] == "3"
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")


def test_unknown_model_is_404_naming_model(app: FastAPI) -> None:
    error = assert_openai_error(call(app, "GET", "/missing-model"), 404, "model")
    assert error["code"] == "model_not_found"
    assert "gpt-4" in error["message"] and "stories260K" in error["message"]


def test_service_unavailable_is_503(app: FastAPI) -> None:
    error = assert_openai_error(call(app, "GET", "/draining"), 503)
    assert error["message"] == "The server is shutting down."


def test_openai_error_body_shape() -> None:
    error = OpenAIError(400, "bad n", param="n")
    assert error.body() == {"error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": 400}}
    assert OpenAIError(404, "x", code="model_not_found").body()["error"]["code"] == "model_not_found"


# --- auth ----------------------------------------------------------------------------------------------------

KEYS = ["key-one", "key-two", "key-three"]


@pytest.fixture(scope="module")
def secured(app: FastAPI) -> ApiKeyMiddleware:
    return ApiKeyMiddleware(app, KEYS)


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
def test_probe_and_metrics_paths_need_no_key(secured: ApiKeyMiddleware, path: str) -> None:
    assert call(secured, "GET", path).status == 200


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("Authorization", "Bearer wrong")],
        [("Authorization", "Bearer key-one-and-more")],
        [("Authorization", "Basic key-one")],
        [("Authorization", "key-one")],
        [("Authorization", "Bearer ")],
    ],
)
def test_other_paths_are_401_without_a_valid_key(secured: ApiKeyMiddleware, headers: list[tuple[str, str]]) -> None:
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/nothing-here"), ("GET", "/health/")]:
        response = call(secured, method, path, headers=headers)
        error = assert_openai_error(response, 401)
        assert error["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
        assert b"key-one" not in response.body


@pytest.mark.parametrize("key", KEYS)
def test_any_configured_key_is_accepted(secured: ApiKeyMiddleware, key: str) -> None:
    assert call(secured, "GET", "/v1/models", headers=[("Authorization", f"Bearer {key}")]).status == 200
    assert call(secured, "GET", "/v1/models", headers=[("authorization", f"bearer {key}")]).status == 200


def test_no_keys_means_no_auth(app: FastAPI) -> None:
    assert call(ApiKeyMiddleware(app, []), "GET", "/v1/models").status == 200


@pytest.mark.parametrize("token", ["key-one", "key-three", "wrong", None])
def test_every_key_is_compared_in_constant_time(
    secured: ApiKeyMiddleware, monkeypatch: pytest.MonkeyPatch, token: Optional[str]
) -> None:
    calls = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    headers = [("Authorization", f"Bearer {token}")] if token else []
    call(secured, "GET", "/v1/models", headers=headers)
    assert len(calls) == len(KEYS)


def test_lifespan_passes_through_untouched() -> None:
    seen = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    asyncio.run(ApiKeyMiddleware(inner, KEYS)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_resolve_api_keys_merges_cli_and_environment() -> None:
    environ = {"PAGODA_API_KEY": "env-key", "VLLM_API_KEY": " vllm-key "}
    assert resolve_api_keys(["cli-1", "", "cli-2", "cli-1"], environ) == ["cli-1", "cli-2", "env-key", "vllm-key"]
    assert resolve_api_keys([], {"PAGODA_API_KEY": "", "OTHER": "x"}) == []
    assert resolve_api_keys([], {"VLLM_API_KEY": "a,b"}) == ["a,b"]
