"""`pagoda serve`'s own options: :class:`ServerConfig` and its :class:`ServerLimits`, each field also the flag of the
same name (see :mod:`pagoda.options`), with its default, choices and help declared once, here.

Nothing heavy is imported here: the command line (and `pagoda capabilities`, which lists the flags) builds its parser
without loading the server, the tokenizer or torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.config import EngineArgs
from pagoda.lora.sources import LoRAModule, parse_lora_modules
from pagoda.options import option, table_field

# No tokenizer we know averages more than a few characters per token on real text; 16 leaves room for
# whitespace runs and long words, and a prompt that long is over max_model_len anyway.
PROMPT_CHARS_PER_TOKEN = 16

# Where prompts are tokenized (entrypoints/openai/tokenizer_pool.py).
POOL_TYPES = ("process", "thread")
DEFAULT_POOL_TYPE = "process"
DEFAULT_POOL_SIZE = 1

# Output parsers of `pagoda serve` (the tool_parsers package and reasoning_parsers.py hold the same names).
TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json", "mistral")
REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Per-request limits of the HTTP server (each a ``pagoda serve`` flag of the same name): what a single request
    may ask of the server, checked by :mod:`pagoda.entrypoints.openai.limits`."""

    max_request_body_bytes: int = option(8 * 1024 * 1024, "larger request bodies get 413")
    max_prompt_chars: Optional[int] = option(  # None: PROMPT_CHARS_PER_TOKEN x max_model_len
        None,
        "characters per prompt (a chat's messages together; each stop string), refused before tokenizing "
        f"(default: {PROMPT_CHARS_PER_TOKEN} x max-model-len)",
    )
    max_prompts_per_request: int = option(256, "prompts in one completions request")
    max_messages: int = option(1024, "messages in one chat")
    max_stop_sequences: int = option(64, "stop strings, and stop_token_ids, per request")
    max_logit_bias: int = option(1024, "logit_bias entries per request")
    max_n: int = option(128, "largest n (completions per prompt)")
    http_header_timeout: float = option(
        10.0, "seconds for a request's line and headers to arrive; then 408 and the connection is closed"
    )
    http_body_timeout: float = option(30.0, "seconds for a request body to arrive; then 408")
    max_tools: int = option(128, "tools in one chat request")
    # A JSON Schema of a few hundred properties is tens of KiB; compiling grows with the size.
    max_structured_output_chars: int = option(
        256 * 1024,
        "characters of one output constraint (JSON Schema, regex, grammar, choices, or the tools' schemas)",
    )
    structured_output_compile_timeout: float = option(
        30.0, "seconds a request waits for its output constraint to compile; then 400, and the compile is abandoned"
    )
    max_pending_compiles: int = option(
        64, "output constraints queued or compiling at once (a small pool of threads); a new one beyond gets 429"
    )
    # Abandoned compiles cannot be interrupted (native code) and keep burning CPU until they finish.
    max_abandoned_compiles: int = option(
        2, "compiles past --structured-output-compile-timeout still running; while that many run, new ones get 429"
    )
    structured_output_cache_entries: int = option(512, "compiled output constraints kept for reuse")
    structured_output_cache_bytes: int = option(
        256 * 1024 * 1024, "bytes of compiled output constraints kept for reuse (one can be tens of MB)"
    )

    def validate(self) -> None:
        """ValueError naming the flag of any limit that is not positive."""
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")

    def prompt_chars(self, max_model_len: int) -> int:
        """The prompt character limit in effect for a model of ``max_model_len`` tokens."""
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len


def _as_tuple(values: Optional[list[str]]) -> tuple[str, ...]:
    """The values of a repeatable flag; a value that is a JSON list (vLLM's form, ``'["*"]'``) gives its items."""
    items: list[str] = []
    for value in values or ():
        if value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"cannot parse {value!r} as a JSON list: {exc}") from None
            if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
                raise ValueError(f"{value!r} must be a JSON list of strings")
            items.extend(parsed)
        else:
            items.append(value)
    return tuple(items)


def _all_unless_given(values: Optional[list[str]]) -> tuple[str, ...]:
    return _as_tuple(values) or ("*",)


def _one_name(values: Optional[list[str]]) -> Optional[str]:
    """--served-model-name takes vLLM's list form, of one name: aliases are not served."""
    if values is not None and len(values) > 1:
        raise ValueError(f"--served-model-name: one name is served, got {len(values)} ({', '.join(values)})")
    return values[0] if values else None


def _paths_flag(values: Optional[list[str]]) -> tuple[str, ...]:
    return tuple(values or ())


def _lora_modules_flag(values: Optional[list[str]]) -> tuple[LoRAModule, ...]:
    return tuple(parse_lora_modules(values or []))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Server settings; the engine's own are in ``engine_args``."""

    engine_args: EngineArgs
    host: str = option("127.0.0.1", "address to bind (0.0.0.0 in a pod)")
    port: int = option(8000, "port to bind")
    served_model_name: Optional[str] = option(
        None, "model name clients use (default: the model path)", nargs="+", parse=_one_name
    )
    # From the command line: the --api-key flags, then the environment's keys (see auth.resolve_api_keys).
    api_keys: tuple[str, ...] = option(
        (),
        "require this bearer key (one or more, repeatable; env PAGODA_API_KEY, VLLM_API_KEY)",
        flag="--api-key",
        action="extend",
        nargs="+",
    )
    max_num_queued_requests: int = option(
        1024,
        "sequences (prompts x n) that may wait for the engine; a request that would exceed it gets 429 with "
        "Retry-After",
    )
    shutdown_timeout: float = option(30.0, "seconds in-flight requests get to finish after SIGTERM")
    limits: ServerLimits = table_field(ServerLimits)
    allowed_origins: tuple[str, ...] = option(  # CORS: none by default
        (),
        "CORS: an origin browsers may call from (repeatable; '*' for any). Default: none, CORS off",
        action="append",
        parse=_as_tuple,
    )
    allow_credentials: bool = option(False, "CORS: allow cookies and auth headers")
    allowed_methods: tuple[str, ...] = option(
        ("*",),
        "CORS: a method browsers may use (repeatable, or a JSON list as vLLM takes it)",
        action="append",
        parse=_all_unless_given,
    )
    allowed_headers: tuple[str, ...] = option(
        ("*",),
        "CORS: a request header browsers may send (repeatable, or a JSON list)",
        action="append",
        parse=_all_unless_given,
    )
    tokenizer_pool_type: str = option(
        DEFAULT_POOL_TYPE,
        "where prompts are tokenized and chat templates rendered: worker processes or threads",
        choices=POOL_TYPES,
    )
    tokenizer_pool_size: int = option(DEFAULT_POOL_SIZE, "tokenizer workers (processes or threads)")
    enable_auto_tool_choice: bool = option(
        False, 'tool_choice "auto": the model decides to call tools; needs --tool-call-parser'
    )
    tool_call_parser: Optional[str] = option(
        None,
        "how tool calls are read from the model's output (hermes: Qwen2/Qwen3/Hermes; llama3_json; mistral)",
        choices=TOOL_CALL_PARSER_NAMES,
    )
    reasoning_parser: Optional[str] = option(
        None, "split <think>...</think> into reasoning_content (qwen3, deepseek_r1)", choices=REASONING_PARSER_NAMES
    )
    lora_modules: tuple[LoRAModule, ...] = option(  # served from the start (needs engine_args.enable_lora)
        (),
        "adapters served at start: name=path, or vLLM's JSON form "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; path: a local folder, an org/name Hub id, hf:// or '
        "s3://. A request's model field selects one",
        nargs="+",
        parse=_lora_modules_flag,
    )
    lora_modules_file: Optional[str] = option(  # a watched adapter list (see lora_serving)
        None,
        "a JSON list of {name, path} adapters, read at start and re-read every --lora-modules-poll-seconds: "
        "adapters added are loaded, removed ones unloaded, without a restart (the operator mounts a ConfigMap here)",
    )
    lora_modules_poll_seconds: float = option(5.0, "how often --lora-modules-file is re-read")
    lora_allowed_roots: tuple[str, ...] = option(  # confinement of runtime loads (lora.sources)
        (),
        "folders POST /v1/load_lora_adapter may read local adapters from (symlinks resolved first; regular files "
        "only); default: the download cache and the --lora-modules folders",
        nargs="+",
        parse=_paths_flag,
    )
    allow_runtime_lora_updates: bool = option(  # the load/unload endpoints
        False,
        "enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key like every /v1 route)",
    )
    max_stored_responses: int = option(  # the Responses API's in-memory store (response_store)
        1000,
        "responses kept for GET /v1/responses/{id} and previous_response_id (least recently used evicted first; "
        "also bounded to 64 MiB)",
    )

    # Response shaping, named like vllm serve's flags (the serving classes read them via RequestOptions).
    return_tokens_as_token_ids: bool = option(
        False, 'logprobs name each token "token_id:N" instead of its text (tokens that are not valid UTF-8 included)'
    )
    strict_request_fields: bool = option(
        False, "refuse (400) request fields this server does not know instead of ignoring them"
    )
    enable_force_include_usage: bool = option(
        False, "streamed responses end with a usage chunk even when stream_options.include_usage is not set"
    )
    response_role: str = option("assistant", "role of the chat completion's message (add_generation_prompt true)")
    # How uvicorn serves (named like vllm serve's flags).
    uvicorn_log_level: Optional[str] = option(
        None, "uvicorn's log level (default: --log-level)", choices=UVICORN_LOG_LEVELS
    )
    ssl_keyfile: Optional[str] = option(None, "serve HTTPS: the private key file (PEM), with --ssl-certfile")
    ssl_certfile: Optional[str] = option(None, "serve HTTPS: the certificate chain file (PEM), with --ssl-keyfile")
    ssl_ca_certs: Optional[str] = option(
        None, "HTTPS: CA certificates (PEM) that client certificates are checked against"
    )
    ssl_cert_reqs: int = option(
        0,
        "HTTPS: client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_* values)",
        choices=(0, 1, 2),
    )
    root_path: str = option(
        "", "the path prefix a proxy strips before forwarding (FastAPI's root_path: the OpenAPI servers and docs)"
    )
    disable_fastapi_docs: bool = option(False, "no /docs, /redoc or /openapi.json")
    disable_uvicorn_access_log: bool = option(False, "no access log (it is written only at --log-level debug)")

    def uvicorn_options(self, log_level: str) -> dict[str, Any]:
        """uvicorn.Config's settings from the flags: its log level, the access log (at debug), TLS."""
        return {
            "log_level": self.uvicorn_log_level or log_level,
            "access_log": log_level == "debug" and not self.disable_uvicorn_access_log,
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_cert_reqs": self.ssl_cert_reqs,
        }

    def fastapi_options(self) -> dict[str, Any]:
        """FastAPI's settings from the flags: --disable-fastapi-docs."""
        return {"docs_url": None, "redoc_url": None, "openapi_url": None} if self.disable_fastapi_docs else {}

    def validate(self) -> None:
        """ValueError for any setting out of range (the engine's that do not depend on the model included), before
        the port is bound."""
        self.engine_args.validate()
        self.limits.validate()
        if self.max_num_queued_requests < 1:
            raise ValueError("--max-num-queued-requests must be at least 1")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.lora_modules_poll_seconds <= 0:
            raise ValueError("--lora-modules-poll-seconds must be greater than 0")
        if self.tokenizer_pool_size < 1:
            raise ValueError("--tokenizer-pool-size must be at least 1")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path must start with '/', got {self.root_path!r}")
