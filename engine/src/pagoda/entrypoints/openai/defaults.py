"""The defaults of `pagoda serve`'s own flags, in a module with no imports: the command line (and
`pagoda capabilities`, which lists the flags) builds its parser without loading the server, the tokenizer or torch."""

DEFAULT_MAX_NUM_QUEUED_REQUESTS = 1024
DEFAULT_SHUTDOWN_TIMEOUT = 30.0

# Per-request limits (entrypoints/openai/limits.py).
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
# No tokenizer we know averages more than a few characters per token on real text; 16 leaves room for
# whitespace runs and long words, and a prompt that long is over max_model_len anyway.
PROMPT_CHARS_PER_TOKEN = 16
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
DEFAULT_MAX_MESSAGES = 1024
DEFAULT_MAX_STOP_SEQUENCES = 64
DEFAULT_MAX_LOGIT_BIAS = 1024
DEFAULT_MAX_N = 128
DEFAULT_HTTP_HEADER_TIMEOUT = 10.0
DEFAULT_HTTP_BODY_TIMEOUT = 30.0
DEFAULT_MAX_TOOLS = 128
# A JSON Schema of a few hundred properties is tens of KiB; compiling grows with the size.
DEFAULT_MAX_STRUCTURED_OUTPUT_CHARS = 256 * 1024
DEFAULT_STRUCTURED_OUTPUT_COMPILE_TIMEOUT = 30.0
DEFAULT_MAX_PENDING_COMPILES = 64

# Where prompts are tokenized (entrypoints/openai/tokenizer_pool.py).
POOL_TYPES = ("process", "thread")
DEFAULT_POOL_TYPE = "process"
DEFAULT_POOL_SIZE = 1

# Output parsers of `pagoda serve` (the tool_parsers package and reasoning_parsers.py hold the same names).
TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json", "mistral")
REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1")
