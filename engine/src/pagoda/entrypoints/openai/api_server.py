"""`pagoda serve`: the OpenAI-compatible HTTP server.

The HTTP server binds at once; the model loads in a background thread (``/health`` is 200
meanwhile, ``/ready`` 503 until it is loaded). Model compute runs on the engine thread and
tokenizing on the tokenizer pool, never on the event loop. SIGTERM/SIGINT start a drain: ``/ready``
and new requests answer 503, in-flight requests get ``--shutdown-timeout`` seconds to finish, the
rest are aborted. If the engine loop itself fails (a device or process fault, never one request's
input), ``/health`` turns 503, in-flight requests get 503 and the process exits with status 1. If the model
cannot be loaded, the reason goes to the termination message (see ``pagoda.startup_failure``) and the process
exits with status 1.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.openai.asgi import HTTPMiddleware
from pagoda.entrypoints.openai.auth import DEFAULT_EXEMPT_PATHS, ApiKeyMiddleware
from pagoda.entrypoints.openai.defaults import ServerConfig, ServerLimits
from pagoda.entrypoints.openai.errors import install_error_handlers, not_found_model, service_unavailable
from pagoda.entrypoints.openai.http_guards import BodyLimitMiddleware, RequestIdMiddleware, header_timeout_protocol
from pagoda.entrypoints.openai.limits import AdmissionControl, RequestChecker
from pagoda.entrypoints.openai.lora_serving import LoRAAdapters, LoRAFileWatcher, add_lora_routes
from pagoda.entrypoints.openai.openapi import install_openapi, route_responses
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagoda.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagoda.entrypoints.openai.response_store import ResponseStore
from pagoda.entrypoints.openai.serving import OpenAIServing
from pagoda.entrypoints.openai.serving_base import RequestOptions
from pagoda.entrypoints.openai.serving_chat import ChatOptions
from pagoda.entrypoints.openai.serving_pooling import add_pooling_routes, load_pooling
from pagoda.entrypoints.openai.serving_responses import ResponsesServing, add_responses_routes
from pagoda.entrypoints.openai.structured_request import configure_compiler
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool, TokenizerSpec
from pagoda.entrypoints.openai.tool_parsers import get_tool_parser
from pagoda.lora.sources import default_allowed_roots
from pagoda.metrics import EngineMetrics
from pagoda.startup_failure import report_startup_failure
from pagoda.version import __version__

logger = logging.getLogger(__name__)

# Probes and the operator's reads need no key: /metrics (autoscaler) and /lora_adapters (adapter status, without
# paths or errors for callers without the key: see lora_serving).
AUTH_EXEMPT_PATHS = DEFAULT_EXEMPT_PATHS | {"/lora_adapters"}
_TRACKED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


# What clients are told when loading failed or the engine stopped; the cause is in the log (and, for a
# failed start, in the exit status), never in a response body.
_LOAD_FAILED = "the model failed to load; the server log has the cause"
_ENGINE_STOPPED = "the engine stopped after an internal error; the server is exiting"


@dataclass(slots=True)
class ServerState:
    """What the routes share: the engine once loaded, readiness, drain and in-flight count."""

    config: ServerConfig
    model_name: str
    # set by the loader thread once the model is loaded (None until then: /ready answers 503)
    engine: Optional[AsyncLLMEngine] = None
    serving: Optional[OpenAIServing] = None
    responses: Optional[ResponsesServing] = None  # POST /v1/responses and the stored responses
    metrics: Optional[EngineMetrics] = None
    pool: Optional[TokenizerPool] = None
    lora: Optional[LoRAAdapters] = None  # with --enable-lora
    lora_watcher: Optional[LoRAFileWatcher] = None  # with --lora-modules-file
    load_error: Optional[str] = None  # why loading failed (the termination message says the same)
    draining: bool = False  # after the first SIGTERM: /ready and new requests answer 503
    in_flight: int = 0  # requests between arrival and their last byte
    started: float = field(default_factory=time.time)
    exit_code: int = 0
    # Set by run_server: ends the process with this status (thread-safe); None when there is no server.
    request_exit: Optional[Callable[[int], None]] = None

    def load(self) -> None:
        """Load the model, start the tokenizer pool and the engine thread (runs on a background thread)."""
        try:
            # A remote model is downloaded (or found in the cache) first; then the tokenizer workers start (a process
            # each: seconds) while the model loads.
            args = self.config.engine_args.with_local_paths()
            self.pool = TokenizerPool(
                TokenizerSpec(args.tokenizer or str(args.model), args.chat_template),
                self.config.tokenizer_pool_type,
                self.config.tokenizer_pool_size,
            )
            starting = self.pool.start()
            if args.task != "generate":  # embeddings / scores: the pooling engine, no KV cache (serving_pooling)
                self.engine, self.serving = load_pooling(args, self.config, self.model_name, self.pool, starting)
                return
            engine = LLMEngine(args)
            stats = engine.get_stats()
            self.metrics = EngineMetrics(
                self.model_name,
                stats.block_size,
                stats.num_blocks,
                max_model_len=engine.max_model_len,
                max_loras=args.lora_slots,
            )
            self._load_adapters(engine)
            starting.wait()
            metrics = self.metrics
            async_engine = AsyncLLMEngine(
                engine,
                on_step=lambda e, num_tokens: metrics.record_step(e.get_stats(), num_tokens),
                on_dead=self._engine_died,
            )
            limits = self.config.limits
            self.serving = OpenAIServing(
                async_engine,
                self.model_name,
                self.pool,
                RequestChecker(limits, limits.prompt_chars(engine.max_model_len)),
                AdmissionControl(self.config.max_num_queued_requests, lambda: async_engine.num_waiting_seqs),
                self.metrics,
                chat_options(self.config),
                request_options=RequestOptions.from_config(self.config),
            )
            store = ResponseStore(self.config.max_stored_responses)
            self.responses = ResponsesServing(self.serving, self.serving.chat_options, store)
            # xgrammar's import and tokenizer tables: before the server is ready, not on the first request (nor
            # beside the first requests, where its import holds the GIL for a tenth of a second or more).
            _warm_up_structured_outputs(engine, self.config.limits)
            # What start-up made (torch, transformers, the model's modules: millions of objects) lives as long as
            # the process: frozen, a full collection no longer walks it (one took 150 ms, stalling every request).
            gc.collect()
            gc.freeze()
            self.engine = async_engine
            logger.info("model %s loaded; ready", self.model_name)
        except Exception as exc:  # in the log, the termination message, /health and /ready; then exit 1
            logger.error("loading the model failed: %s", report_startup_failure(exc), exc_info=exc)
            self.load_error = _LOAD_FAILED
            self.exit_code = 1
            if self.request_exit is not None:
                self.request_exit(1)  # a pod that cannot load its model restarts (and says why) instead of idling

    def _load_adapters(self, engine: LLMEngine) -> None:
        """The flags' adapters (a failure fails the start) and the adapter list file, before the server is ready."""
        if not self.config.engine_args.enable_lora:
            return
        roots = self.config.lora_allowed_roots or default_allowed_roots(
            self.config.engine_args.download_dir, self.config.lora_modules
        )
        self.lora = LoRAAdapters(engine, frozenset({self.model_name}), tuple(Path(r) for r in roots))
        for module in self.config.lora_modules:
            self.lora.load(module, "flag")
        if self.config.lora_modules_file:
            self.lora_watcher = LoRAFileWatcher(
                self.lora, Path(self.config.lora_modules_file), self.config.lora_modules_poll_seconds
            )
            self.lora_watcher.sync_once()
            self.lora_watcher.start()

    def _engine_died(self, error: BaseException) -> None:
        """Engine thread, once: the loop failed. Every request has its 503; now exit non-zero so that
        Kubernetes restarts the pod instead of leaving it up and useless."""
        logger.critical("the engine stopped (%r); exiting with status 1", error)
        self.exit_code = 1
        if self.request_exit is not None:
            self.request_exit(1)

    def check_admission(self, model: Optional[str]) -> OpenAIServing:
        if self.draining:
            raise service_unavailable("the server is shutting down")
        if self.engine is not None and not self.engine.is_alive:
            raise service_unavailable(_ENGINE_STOPPED)
        if self.serving is None or self.engine is None:
            raise service_unavailable(self.load_error or "the model is still loading")
        if model is not None and model != self.model_name:
            lora = self.engine.engine.lora
            if lora is None or lora.lookup(model) is None:
                adapters = [r.name for r in lora.loaded()] if lora is not None else []
                raise not_found_model(model, [self.model_name, *adapters])
        return self.serving


class _InFlight(HTTPMiddleware):
    """Counts API requests until their response (streamed or not) is fully sent."""

    def __init__(self, app, state: ServerState) -> None:
        super().__init__(app)
        self.state = state

    def applies_to(self, scope) -> bool:
        return scope["path"].startswith(_TRACKED_PREFIXES)

    async def handle(self, scope, receive, send) -> None:
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
        if state.lora_watcher is not None:
            state.lora_watcher.stop()
        if state.engine is not None:
            state.engine.shutdown(timeout=5)
        if state.pool is not None:
            state.pool.shutdown()

    app = FastAPI(title="Pagoda", version=__version__, lifespan=lifespan, **config.fastapi_options())
    app.root_path = config.root_path  # the prefix a proxy strips: the docs and OpenAPI servers name it
    app.state.pagoda = state
    install_error_handlers(app)
    install_openapi(app)
    # Outermost last: request id, CORS (its preflights need no key), API key, body limit, in-flight count.
    app.add_middleware(_InFlight, state=state)
    limits = config.limits
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes, timeout=limits.http_body_timeout)
    app.add_middleware(ApiKeyMiddleware, api_keys=list(config.api_keys), exempt_paths=AUTH_EXEMPT_PATHS)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_credentials=config.allow_credentials,
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(RequestIdMiddleware)
    _add_routes(app, state)
    return app


def _warm_up_structured_outputs(engine: LLMEngine, limits: ServerLimits) -> None:
    # A tokenizer xgrammar cannot read is logged once; requests that ask for structured outputs get a 400 saying why.
    # The cache and abandon bounds apply from here on (a request that came first compiled under the defaults).
    with contextlib.suppress(ValueError):
        configure_compiler(engine.structured_output_compiler(), limits)


def chat_options(config: ServerConfig) -> ChatOptions:
    """The chat flags as the parsers they name."""
    return ChatOptions(
        enable_auto_tool_choice=config.enable_auto_tool_choice,
        tool_parser=get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None,
        reasoning_parser=get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None,
    )


def _add_routes(app: FastAPI, state: ServerState) -> None:
    def route(method: str, path: str):
        return getattr(app, method)(path, response_model=None, responses=route_responses(path))

    @route("get", "/health")
    async def health() -> Response:
        if state.load_error is not None:
            return service_unavailable(state.load_error).response()
        if state.engine is not None and not state.engine.is_alive:
            return service_unavailable(_ENGINE_STOPPED).response()
        return JSONResponse({"status": "ok"})

    @route("get", "/ready")
    async def ready() -> Response:
        if state.engine is None or state.draining or not state.engine.is_alive:
            reason = "draining" if state.draining else ("failed" if state.load_error or state.engine else "loading")
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    @route("get", "/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
        payload, content_type = state.metrics.render()
        return Response(payload, media_type=content_type)

    @route("get", "/version")
    async def version() -> dict:
        return {"version": __version__}

    @route("get", "/v1/models")
    async def models() -> dict:
        max_len = state.engine.engine.max_model_len if state.engine is not None else None
        card = {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "pagoda"}
        cards = [{**card, "root": state.model_name, "parent": None, "max_model_len": max_len}]
        lora = state.engine.engine.lora if state.engine is not None else None
        for record in lora.loaded() if lora is not None else []:
            adapter = {"id": record.name, "object": "model", "created": record.created, "owned_by": "pagoda"}
            cards.append({**adapter, "root": record.path, "parent": state.model_name, "max_model_len": max_len})
        return {"object": "list", "data": cards}

    config = state.config
    add_pooling_routes(app, state.check_admission)  # /v1/embeddings, /v1/score, /v1/rerank, /rerank
    add_lora_routes(
        app,
        lambda: state.lora,
        config.engine_args.enable_lora,
        config.allow_runtime_lora_updates,
        route,
        ApiKeyMiddleware(app, list(config.api_keys)).is_authorized,
    )

    @route("post", "/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await state.check_admission(body.model).completions(body, raw)

    @route("post", "/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        return await state.check_admission(body.model).chat(body, raw)

    # POST /v1/responses, and GET, DELETE and POST .../cancel of /v1/responses/{response_id}
    add_responses_routes(app, route, state.check_admission, lambda: state.responses)

    @route("post", "/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return await state.check_admission(body.model).tokenize(body)

    @route("post", "/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await state.check_admission(body.model).detokenize(body)


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
    """Serve until a signal (exit status 0) or an engine failure (1); returns the exit status."""
    app = build_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        timeout_graceful_shutdown=int(config.shutdown_timeout) + 10,
        http=header_timeout_protocol(config.limits.http_header_timeout),
        **config.uvicorn_options(log_level),  # log level, access log, TLS
    )
    state: ServerState = app.state.pagoda
    server = _DrainingServer(uv_config, state)

    def request_exit(code: int) -> None:
        state.exit_code = code
        server.should_exit = True  # uvicorn's main loop polls it

    state.request_exit = request_exit
    server.run()
    return state.exit_code
