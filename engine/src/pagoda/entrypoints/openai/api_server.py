"""`pagoda serve`: the OpenAI-compatible HTTP server.

The HTTP server binds at once; the model loads in a background thread (``/health`` is 200
meanwhile, ``/ready`` 503 until it is loaded). Model compute runs on the engine thread, never
on the event loop. SIGTERM/SIGINT start a drain: ``/ready`` and new requests answer 503,
in-flight requests get ``--shutdown-timeout`` seconds to finish, the rest are aborted.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import pagoda
from pagoda.config import EngineArgs
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.auth import ApiKeyMiddleware
from pagoda.entrypoints.openai.errors import (
    OpenAIError,
    install_error_handlers,
    not_found_model,
    service_unavailable,
    too_many_requests,
)
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagoda.entrypoints.openai.serving import OpenAIServing
from pagoda.metrics import EngineMetrics
from pagoda.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_QUEUED_REQUESTS = 1024
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
_TRACKED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Server settings; the engine's own are in ``engine_args``."""

    engine_args: EngineArgs
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    api_keys: tuple[str, ...] = ()
    max_num_queued_requests: int = DEFAULT_MAX_NUM_QUEUED_REQUESTS
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT


@dataclass(slots=True)
class ServerState:
    """What the routes share: the engine once loaded, readiness, drain and in-flight count."""

    config: ServerConfig
    model_name: str
    engine: Optional[AsyncLLMEngine] = None
    serving: Optional[OpenAIServing] = None
    metrics: Optional[EngineMetrics] = None
    load_error: Optional[str] = None
    draining: bool = False
    in_flight: int = 0
    started: float = field(default_factory=time.time)

    def load(self) -> None:
        """Load the model and start the engine thread (runs on a background thread)."""
        try:
            engine = LLMEngine(self.config.engine_args)
            stats = engine.get_stats()
            self.metrics = EngineMetrics(
                self.model_name, stats.block_size, stats.num_blocks, max_model_len=engine.max_model_len
            )
            metrics = self.metrics
            async_engine = AsyncLLMEngine(
                engine, on_step=lambda e, num_tokens: metrics.record_step(e.get_stats(), num_tokens)
            )
            self.serving = OpenAIServing(
                async_engine, self.model_name, self.config.engine_args.chat_template, self.metrics
            )
            self.engine = async_engine
            logger.info("model %s loaded; ready", self.model_name)
        except Exception as exc:  # reported by /health and /ready, and in the log
            logger.exception("loading the model failed")
            self.load_error = f"{type(exc).__name__}: {exc}"

    def check_admission(self, model: Optional[str]) -> OpenAIServing:
        if self.draining:
            raise service_unavailable("the server is shutting down")
        if self.serving is None or self.engine is None:
            raise service_unavailable(self.load_error or "the model is still loading")
        if model is not None and model != self.model_name:
            raise not_found_model(model, [self.model_name])
        if self.engine.num_waiting >= self.config.max_num_queued_requests:
            raise too_many_requests(1)
        return self.serving


class _InFlight:
    """Counts API requests until their response (streamed or not) is fully sent."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_TRACKED_PREFIXES):
            await self.app(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def build_app(config: ServerConfig) -> FastAPI:
    """The FastAPI app; the model starts loading when the app starts."""
    name = config.served_model_name or (config.engine_args.model or "stories260K")
    state = ServerState(config=config, model_name=name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="pagoda-loader", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown(timeout=5)

    app = FastAPI(title="Pagoda", version=pagoda.__version__, lifespan=lifespan)
    app.state.pagoda = state
    install_error_handlers(app)
    app.add_middleware(_InFlight, state=state)
    app.add_middleware(ApiKeyMiddleware, api_keys=list(config.api_keys))
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        if state.load_error is not None or (state.engine is not None and not state.engine.is_alive):
            return JSONResponse(
                service_unavailable(state.load_error or "the engine loop stopped").body(), status_code=503
            )
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready():
        if state.engine is None or state.draining or not state.engine.is_alive:
            reason = "draining" if state.draining else (state.load_error or "loading")
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
        payload, content_type = state.metrics.render()
        return Response(payload, media_type=content_type)

    @app.get("/version")
    async def version():
        return {"version": pagoda.__version__}

    @app.get("/v1/models")
    async def models():
        max_len = state.engine.engine.max_model_len if state.engine is not None else None
        card = {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "pagoda"}
        return {"object": "list", "data": [{**card, "root": state.model_name, "max_model_len": max_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await state.check_admission(body.model).completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await state.check_admission(body.model).chat(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving = state.check_admission(body.model)
        tokenizer = serving.tokenizer
        if body.messages is not None:
            try:
                tokens = apply_chat_template(
                    tokenizer, body.messages, serving.chat_template, body.add_generation_prompt
                )
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="messages") from None
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.engine.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving = state.check_admission(body.model)
        vocab = serving.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}


class _DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM/SIGINT instead of closing at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self.state.draining = True
        logger.info(
            "draining: %d requests in flight, up to %.0f s", self.state.in_flight, self.state.config.shutdown_timeout
        )
        threading.Thread(target=self._drain, name="pagoda-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.state.config.shutdown_timeout
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state.in_flight > 0:
            logger.warning("shutdown timeout: aborting %d requests", self.state.in_flight)
            if self.state.engine is not None:
                self.state.engine.shutdown(timeout=5)
            time.sleep(0.5)  # let the aborted responses go out
        self.should_exit = True


def run_server(config: ServerConfig, log_level: str = "info") -> int:
    """Serve until a signal; returns the process exit code."""
    app = build_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        timeout_graceful_shutdown=int(config.shutdown_timeout) + 10,
        access_log=log_level == "debug",
    )
    server = _DrainingServer(uv_config, app.state.pagoda)
    server.run()
    return 0
