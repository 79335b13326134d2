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

# Where prompts are tokenized (entrypoints/openai/tokenizer_pool.py).
POOL_TYPES = ("process", "thread")
DEFAULT_POOL_TYPE = "process"
DEFAULT_POOL_SIZE = 1
