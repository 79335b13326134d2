"""`pagoda serve`: its flags (besides the engine's) and the step from parsed flags to a running server."""

from __future__ import annotations

import argparse
import os

from pagoda import capabilities as caps


def run_serve(ns: argparse.Namespace) -> int:
    """Check every flag, then serve until a signal (0) or a failure (non-zero)."""
    from pagoda.cli import engine_args_from
    from pagoda.entrypoints.openai.api_server import ServerConfig, run_server
    from pagoda.entrypoints.openai.auth import resolve_api_keys
    from pagoda.entrypoints.openai.limits import ServerLimits
    from pagoda.lora.sources import parse_lora_modules

    _reject_unsupported(ns)
    limits = ServerLimits(**{name: getattr(ns, name) for name in ServerLimits.__dataclass_fields__})
    config = ServerConfig(
        engine_args=engine_args_from(ns),
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        api_keys=tuple(resolve_api_keys(ns.api_key or [], os.environ)),
        max_num_queued_requests=ns.max_num_queued_requests,
        shutdown_timeout=ns.shutdown_timeout,
        limits=limits,
        allowed_origins=tuple(ns.allowed_origins or ()),
        allow_credentials=ns.allow_credentials,
        tokenizer_pool_type=ns.tokenizer_pool_type,
        tokenizer_pool_size=ns.tokenizer_pool_size,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        lora_modules=tuple(parse_lora_modules(ns.lora_modules or [])),
        lora_modules_file=ns.lora_modules_file,
        lora_modules_poll_seconds=ns.lora_modules_poll_seconds,
        allow_runtime_lora_updates=ns.allow_runtime_lora_updates,
    )
    # fail fast on bad flags, before binding the port
    config.engine_args.validate()
    limits.validate()
    if config.max_num_queued_requests < 1:
        raise ValueError("--max-num-queued-requests must be at least 1")
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if config.lora_modules_poll_seconds <= 0:
        raise ValueError("--lora-modules-poll-seconds must be greater than 0")
    if config.tokenizer_pool_size < 1:
        raise ValueError("--tokenizer-pool-size must be at least 1")
    return run_server(config, ns.log_level)


def _reject_unsupported(ns: argparse.Namespace) -> None:
    """Flags of features outside the capability contract: parsed (so deployments can already set them) but refused
    clearly, as the operator refuses the matching ModelDeployment fields."""
    if ns.tensor_parallel_size > caps.TENSOR_PARALLEL_MAX:
        raise ValueError(
            f"--tensor-parallel-size {ns.tensor_parallel_size} is not supported: this engine serves at most "
            f"{caps.TENSOR_PARALLEL_MAX} devices per replica"
        )
    if ns.tensor_parallel_size > 1 and ns.enable_lora and not caps.LORA_WITH_TENSOR_PARALLEL:
        raise ValueError("--enable-lora is not supported with --tensor-parallel-size above 1 yet")
    if (ns.lora_modules or ns.lora_modules_file or ns.allow_runtime_lora_updates) and not ns.enable_lora:
        raise ValueError("--lora-modules, --lora-modules-file and --allow-runtime-lora-updates need --enable-lora")


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    from pagoda.entrypoints.openai.defaults import (
        DEFAULT_MAX_NUM_QUEUED_REQUESTS,
        DEFAULT_POOL_SIZE,
        DEFAULT_POOL_TYPE,
        DEFAULT_SHUTDOWN_TIMEOUT,
        POOL_TYPES,
        REASONING_PARSER_NAMES,
        TOOL_CALL_PARSER_NAMES,
    )

    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: the model path)")
    serve.add_argument(
        "--api-key", action="append", help="require this bearer key (repeatable; env PAGODA_API_KEY, VLLM_API_KEY)"
    )
    serve.add_argument(
        "--max-num-queued-requests",
        type=int,
        default=DEFAULT_MAX_NUM_QUEUED_REQUESTS,
        help="sequences (prompts x n) that may wait for the engine; a request that would exceed it gets 429 with "
        "Retry-After",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    _add_limit_args(serve)
    serve.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        help="CORS: an origin browsers may call from (repeatable; '*' for any). Default: none, CORS off",
    )
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and auth headers")
    serve.add_argument(
        "--tokenizer-pool-type",
        default=DEFAULT_POOL_TYPE,
        choices=list(POOL_TYPES),
        help="where prompts are tokenized and chat templates rendered: worker processes or threads",
    )
    serve.add_argument(
        "--tokenizer-pool-size", type=int, default=DEFAULT_POOL_SIZE, help="tokenizer workers (processes or threads)"
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the model decides to call tools; needs --tool-call-parser',
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSER_NAMES),
        help="how tool calls are read from the model's output (hermes: Qwen2/Qwen3/Hermes; llama3_json; mistral)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=list(REASONING_PARSER_NAMES),
        help="split <think>...</think> into reasoning_content (qwen3, deepseek_r1)",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="adapters served at start: name=path, or vLLM's JSON form "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; path: a local folder, an org/name Hub id, hf:// or '
        "s3://. A request's model field selects one",
    )
    serve.add_argument(
        "--lora-modules-file",
        default=None,
        help="a JSON list of {name, path} adapters, read at start and re-read every --lora-modules-poll-seconds: "
        "adapters added are loaded, removed ones unloaded, without a restart (the operator mounts a ConfigMap here)",
    )
    serve.add_argument(
        "--lora-modules-poll-seconds", type=float, default=5.0, help="how often --lora-modules-file is re-read"
    )
    serve.add_argument(
        "--allow-runtime-lora-updates",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key like every /v1 route)",
    )


def _add_limit_args(serve: argparse.ArgumentParser) -> None:
    """One flag per field of ``ServerLimits``: what a single request may ask of the server."""
    from pagoda.entrypoints.openai import defaults as lim

    chars_default = f"default: {lim.PROMPT_CHARS_PER_TOKEN} x max-model-len"
    flags = [
        ("--max-request-body-bytes", int, lim.DEFAULT_MAX_REQUEST_BODY_BYTES, "larger request bodies get 413"),
        (
            "--max-prompt-chars",
            int,
            None,
            f"characters per prompt (a chat's messages together; each stop string), refused before tokenizing "
            f"({chars_default})",
        ),
        ("--max-prompts-per-request", int, lim.DEFAULT_MAX_PROMPTS_PER_REQUEST, "prompts in one completions request"),
        ("--max-messages", int, lim.DEFAULT_MAX_MESSAGES, "messages in one chat"),
        ("--max-stop-sequences", int, lim.DEFAULT_MAX_STOP_SEQUENCES, "stop strings, and stop_token_ids, per request"),
        ("--max-logit-bias", int, lim.DEFAULT_MAX_LOGIT_BIAS, "logit_bias entries per request"),
        ("--max-n", int, lim.DEFAULT_MAX_N, "largest n (completions per prompt)"),
        (
            "--http-header-timeout",
            float,
            lim.DEFAULT_HTTP_HEADER_TIMEOUT,
            "seconds for a request's line and headers to arrive; then 408 and the connection is closed",
        ),
        ("--http-body-timeout", float, lim.DEFAULT_HTTP_BODY_TIMEOUT, "seconds for a request body to arrive; then 408"),
        ("--max-tools", int, lim.DEFAULT_MAX_TOOLS, "tools in one chat request"),
        (
            "--max-structured-output-chars",
            int,
            lim.DEFAULT_MAX_STRUCTURED_OUTPUT_CHARS,
            "characters of one output constraint (JSON Schema, regex, grammar, choices, or the tools' schemas)",
        ),
        (
            "--structured-output-compile-timeout",
            float,
            lim.DEFAULT_STRUCTURED_OUTPUT_COMPILE_TIMEOUT,
            "seconds a request waits for its output constraint to compile; then 400",
        ),
        (
            "--max-pending-compiles",
            int,
            lim.DEFAULT_MAX_PENDING_COMPILES,
            "output constraints queued or compiling at once (one compile thread); a new one beyond gets 429",
        ),
    ]
    for flag, kind, default, text in flags:
        serve.add_argument(flag, type=kind, default=default, help=text)
