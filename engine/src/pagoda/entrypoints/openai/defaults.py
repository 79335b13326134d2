"""`pagoda serve`'s own options: :class:`ServerConfig` and its :class:`ServerLimits`, each field also the flag of the
same name (see :mod:`pagoda.options`), with its default, choices and help declared once, here.

Nothing heavy is imported here: the command line (and `pagoda capabilities`, which lists the flags) builds its parser
without loading the server, the tokenizer or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    return tuple(values or ())


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
    served_model_name: Optional[str] = option(None, "model name clients use (default: the model path)")
    # From the command line: the --api-key flags, then the environment's keys (see auth.resolve_api_keys).
    api_keys: tuple[str, ...] = option(
        (), "require this bearer key (repeatable; env PAGODA_API_KEY, VLLM_API_KEY)", flag="--api-key", action="append"
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
