"""The ``vllm serve`` flags ``pagoda serve`` takes, and what each means here: one frozen table.

Every entry is one of five kinds:

* ``pagoda``: a Pagoda flag of the same name and meaning (declared with the engine's or the server's options);
* ``default``: accepted; Pagoda always behaves as the flag asks (``--disable-log-requests``);
* ``checked``: accepted for the values listed in ``accepted`` (vLLM's meaning), any other value is refused;
* ``no_effect``: accepted, with one warning at start that it has no effect in Pagoda (``--swap-space``);
* ``refused``: start fails (exit 2) with the reason (``--trust-remote-code``).

``mapped`` flags are read by :mod:`pagoda.vllm_flags.apply` onto the Pagoda setting of the same meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

PAGODA, DEFAULT, CHECKED, MAPPED, NO_EFFECT, REFUSED = "pagoda", "default", "checked", "mapped", "no_effect", "refused"
KINDS = (PAGODA, DEFAULT, CHECKED, MAPPED, NO_EFFECT, REFUSED)


@dataclass(frozen=True, slots=True)
class VllmFlag:
    """One ``vllm serve`` flag: how ``pagoda serve`` reads it and what it does here."""

    flag: str
    kind: str
    meaning: str  # what the flag does in Pagoda (or why it is refused, or has no effect)
    takes: str = "str"  # for flags declared here (not ``pagoda``): switch, str, int, float, optional
    accepted: tuple[Any, ...] = ()  # ``checked``: the values taken
    short: Optional[str] = None  # a second spelling, such as -pp

    @property
    def dest(self) -> str:
        """The parsed namespace's attribute (``--model`` has its own: MODEL is also a positional)."""
        name = self.flag.lstrip("-").replace("-", "_")
        return "model_flag" if name == "model" else name


def _pagoda(flag: str, meaning: str) -> VllmFlag:
    return VllmFlag(flag, PAGODA, meaning)


_SAME = (
    ("--host", "address to bind"),
    ("--port", "port to bind"),
    ("--api-key", "bearer key the /v1 routes require (repeatable; also PAGODA_API_KEY / VLLM_API_KEY)"),
    ("--served-model-name", "the model name clients use (one name)"),
    ("--max-model-len", "context length (default: the model's); 32k = 32000, 32K = 32768 as vLLM reads them"),
    ("--dtype", "weights and activations dtype"),
    ("--seed", "the engine's RNG seed"),
    ("--gpu-memory-utilization", "fraction of GPU memory for weights, activations and KV cache"),
    ("--tensor-parallel-size", "devices per replica (up to the capability contract's maximum)"),
    ("--max-num-seqs", "sequences per step"),
    ("--max-num-batched-tokens", "token budget per step"),
    ("--block-size", "tokens per KV block"),
    ("--enable-prefix-caching", "reuse cached KV blocks (on by default; --no-enable-prefix-caching)"),
    ("--enable-chunked-prefill", "split long prompts over steps (on by default; --no-enable-chunked-prefill)"),
    ("--kv-cache-dtype", "auto, fp8 (vLLM's name of fp8_e4m3), fp8_e4m3, fp8_e5m2"),
    ("--quantization", "awq, gptq, fp8, int8 (others refused by their choices)"),
    ("--enforce-eager", "no CUDA graphs"),
    ("--download-dir", "where downloads go"),
    ("--revision", "Hugging Face branch, tag or commit"),
    ("--tokenizer", "a separate tokenizer"),
    (
        "--generation-config",
        "auto: the model's generation_config.json; vllm: none; a folder: its generation_config.json",
    ),
    ("--override-generation-config", "JSON merged over the model's generation defaults (sampling keys)"),
    ("--hf-overrides", "JSON merged over config.json (keys that keep the weights' shapes; others refused)"),
    ("--kv-events-config", "JSON: KV cache events over ZeroMQ in vLLM's wire format (unknown fields refused)"),
    ("--chat-template", "a Jinja chat template, inline or a file"),
    ("--response-role", "role of the chat completion's message"),
    ("--enable-auto-tool-choice", 'tool_choice "auto"'),
    ("--tool-call-parser", "hermes, llama3_json, mistral"),
    ("--reasoning-parser", "qwen3, deepseek_r1"),
    ("--enable-lora", "serve LoRA adapters"),
    ("--max-loras", "adapters resident at once"),
    ("--max-lora-rank", "largest adapter rank"),
    ("--max-cpu-loras", "adapters kept in host memory"),
    ("--lora-modules", "adapters served from the start (name=path or vLLM's JSON form)"),
    ("--max-logprobs", "largest logprobs / top_logprobs a request may ask for"),
    ("--return-tokens-as-token-ids", 'logprobs name tokens "token_id:N"'),
    ("--enable-force-include-usage", "streams end with a usage chunk"),
    ("--allowed-origins", "CORS origins (repeatable, or vLLM's JSON list); default: CORS off (vLLM: any)"),
    ("--allowed-methods", "CORS methods (JSON list or repeated)"),
    ("--allowed-headers", "CORS headers (JSON list or repeated)"),
    ("--allow-credentials", "CORS credentials"),
    ("--uvicorn-log-level", "uvicorn's log level (--log-level sets Pagoda's)"),
    ("--ssl-keyfile", "HTTPS private key"),
    ("--ssl-certfile", "HTTPS certificate"),
    ("--ssl-ca-certs", "CA certificates for client certificates"),
    ("--ssl-cert-reqs", "client certificates: 0 none, 1 optional, 2 required"),
    ("--root-path", "FastAPI root_path (the prefix a proxy strips)"),
    ("--disable-fastapi-docs", "no /docs, /redoc, /openapi.json"),
    ("--disable-uvicorn-access-log", "no access log"),
    ("--scheduling-policy", "fcfs or priority"),
)

_DECLARED = (
    VllmFlag("--model", MAPPED, "the model (instead of the positional MODEL; both given and different: refused)"),
    VllmFlag("--config", MAPPED, "a YAML file of these flags (dash or underscore keys); the command line wins"),
    VllmFlag(
        "--structured-outputs-config",
        MAPPED,
        'JSON: "backend" auto or xgrammar (Pagoda\'s one backend), "disable_any_whitespace", "disable_fallback"; '
        "other backends and keys refused",
    ),
    VllmFlag("--guided-decoding-backend", MAPPED, "older spelling of the structured outputs backend: auto, xgrammar"),
    VllmFlag(
        "--hf-token", MAPPED, "Hugging Face token for downloads (sets HF_TOKEN); bare: the cached login", "optional"
    ),
    VllmFlag(
        "--tokenizer-revision", MAPPED, "accepted when it is the model's --revision (the tokenizer is read there)"
    ),
    VllmFlag(
        "--trust-remote-code",
        REFUSED,
        "Pagoda never runs a checkpoint's own Python code; its built-in architectures serve the supported models",
        takes="switch",
    ),
    VllmFlag("--skip-tokenizer-init", REFUSED, "the server tokenizes every prompt", takes="switch"),
    VllmFlag("--middleware", REFUSED, "Pagoda does not import middleware classes named on the command line"),
    VllmFlag("--tool-parser-plugin", REFUSED, "Pagoda does not import parser plugins (see --tool-call-parser)"),
    VllmFlag("--reasoning-parser-plugin", REFUSED, "Pagoda does not import parser plugins (see --reasoning-parser)"),
    VllmFlag("--logits-processors", REFUSED, "Pagoda does not import logits processor classes"),
    VllmFlag("--kv-transfer-config", REFUSED, "disaggregated prefill (KV transfer) is not supported"),
    VllmFlag("--speculative-config", REFUSED, "speculative decoding is not supported"),
    VllmFlag("--disable-sliding-window", REFUSED, "sliding-window layers always attend over their window", "switch"),
    VllmFlag(
        "--tokenizer-mode", CHECKED, "auto (the fast tokenizer); slow: see the warning", accepted=("auto", "hf", "slow")
    ),
    VllmFlag("--load-format", CHECKED, "safetensors checkpoints only", accepted=("auto", "safetensors")),
    VllmFlag("--config-format", CHECKED, "Hugging Face config.json only", accepted=("auto", "hf")),
    VllmFlag("--model-impl", CHECKED, "Pagoda's own model implementations", accepted=("auto", "vllm")),
    VllmFlag(
        "--distributed-executor-backend", CHECKED, "one process per rank (multiprocessing)", accepted=("mp", "uni")
    ),
    VllmFlag("--worker-cls", CHECKED, "Pagoda's own worker", accepted=("auto",)),
    VllmFlag("--pipeline-parallel-size", CHECKED, "one pipeline stage", takes="int", accepted=(1,), short="-pp"),
    VllmFlag(
        "--data-parallel-size",
        CHECKED,
        "one engine per pod: scale with replicas",
        takes="int",
        accepted=(1,),
        short="-dp",
    ),
    VllmFlag("--cpu-offload-gb", CHECKED, "weights are not offloaded to CPU memory", takes="float", accepted=(0,)),
    VllmFlag(
        "--chat-template-content-format", CHECKED, "the template is given the messages as sent", accepted=("auto",)
    ),
    VllmFlag("--disable-log-requests", DEFAULT, "Pagoda never logs requests' contents", takes="switch"),
    VllmFlag("--disable-log-stats", DEFAULT, "there is no periodic stats log line; /metrics has the numbers", "switch"),
    VllmFlag("--enable-prompt-tokens-details", DEFAULT, "usage always has prompt_tokens_details", takes="switch"),
    VllmFlag("--enable-reasoning", DEFAULT, "--reasoning-parser alone turns reasoning on", takes="switch"),
    VllmFlag("--disable-frontend-multiprocessing", DEFAULT, "the server and engine share one process", "switch"),
)

_NO_EFFECT = (
    ("--swap-space", "float", "preempted sequences are recomputed, never swapped to CPU memory"),
    ("--disable-custom-all-reduce", "switch", "tensor parallelism uses torch.distributed's all-reduce"),
    ("--num-scheduler-steps", "int", "the scheduler plans every step"),
    ("--async-scheduling", "switch", "scheduling is synchronous with each step"),
    ("--enable-expert-parallel", "switch", "no mixture-of-experts architecture is served"),
    ("--max-seq-len-to-capture", "int", "CUDA graphs are captured for decode batch sizes, not lengths"),
    ("--compilation-config", "str", "models run without torch.compile; --enforce-eager turns CUDA graphs off"),
    ("--limit-mm-per-prompt", "str", "models are text-only"),
    ("--mm-processor-kwargs", "str", "models are text-only"),
    ("--enable-server-load-tracking", "switch", "no /load route; /metrics has the queue"),
    ("--max-log-len", "int", "prompts are never logged"),
    ("--enable-log-requests", "switch", "requests' contents are never logged; --log-level debug writes the access log"),
    ("--enable-log-outputs", "switch", "outputs are never logged"),
    ("--code-revision", "str", "no checkpoint code is run"),
    ("--max-parallel-loading-workers", "int", "weights load in one pass"),
    ("--preemption-mode", "str", "preempted sequences are recomputed"),
    ("--num-gpu-blocks-override", "int", "the KV cache is sized by --gpu-memory-utilization / --kv-cache-memory"),
    ("--calculate-kv-scales", "switch", "FP8 KV scales come from the checkpoint, else 1.0"),
    ("--enable-sleep-mode", "switch", "no sleep/wake routes"),
    ("--api-server-count", "int", "one API server process"),
    ("--otlp-traces-endpoint", "str", "no OpenTelemetry traces"),
    ("--lora-dtype", "str", "adapters run in the model's dtype"),
    ("--fully-sharded-loras", "switch", "LoRA is not served with tensor parallelism"),
    ("--lora-extra-vocab-size", "int", "adapters do not add tokens"),
)

# -O (vLLM's -O3, -O.level=3) is --compilation-config's short form.
_SHORT_FLAGS = {"--compilation-config": "-O"}
VLLM_FLAGS: tuple[VllmFlag, ...] = (
    *(_pagoda(flag, meaning) for flag, meaning in _SAME),
    *_DECLARED,
    *(VllmFlag(flag, NO_EFFECT, why, takes, short=_SHORT_FLAGS.get(flag)) for flag, takes, why in _NO_EFFECT),
)


def flag_table() -> list[dict[str, Any]]:
    """The table as JSON-ready rows (``pagoda capabilities``, the docs)."""
    rows = []
    for entry in VLLM_FLAGS:
        row: dict[str, Any] = {"flag": entry.flag, "kind": entry.kind, "meaning": entry.meaning}
        if entry.accepted:
            row["accepted"] = list(entry.accepted)
        rows.append(row)
    return rows
