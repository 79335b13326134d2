"""Engine arguments (what a user sets, named like vLLM's flags) and their validation.

Each field of :class:`EngineArgs` is also the ``pagoda generate`` / ``pagoda serve`` flag of the same name (see
:mod:`pagoda.options`): its default, choices and help are declared once, here.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

from pagoda.capabilities import (
    CHECKPOINT_QUANTIZATIONS_WITHOUT_TENSOR_PARALLEL,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    KV_CACHE_DTYPES,
    LORA_RANKS,
    QUANTIZATION_DEVICES,
    TASKS,
    TENSOR_PARALLEL_MAX,
    builtin_model_path,
)
from pagoda.kv_events_config import KVEventsConfig, check_kv_events, parse_kv_events_config
from pagoda.model_overrides import check_overrides, json_object_flag
from pagoda.options import option

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_LOGPROBS = 20  # vLLM's
# awq, gptq, fp8, int8 (see pagoda.quantization); the devices of each are in pagoda.capabilities
QUANTIZATIONS = tuple(QUANTIZATION_DEVICES)
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 1024**3
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
# How long a collective waits for a slow rank before the engine gives up on it (a dead or hung worker).
DEFAULT_DISTRIBUTED_TIMEOUT_S = 60.0
DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "float16", "half")  # float, half: aliases
DEVICE_CHOICES = ("auto", "cpu", "cuda")
GENERATION_CONFIGS = ("auto", "vllm")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "score")
MODEL_HELP = (
    "a local model directory, a Hugging Face id (org/name or hf://org/name) or s3://bucket/prefix "
    "(default: the built-in stories260K)"
)

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2}
_SIZE_UNITS |= {"g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(value: Union[int, str]) -> int:
    """Parse a byte count such as ``4294967296``, ``"4GiB"``, ``"512MB"`` or ``"2G"``."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(f"cannot parse {value!r} as a size; use bytes or a unit such as 512MiB, 4GiB")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


def parse_token_count(value: str) -> int:
    """A token count as vLLM writes it: ``4096``, ``32k`` (32000) or ``32K`` (32768); also m/M."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"cannot parse {value!r} as a token count such as 4096, 32k or 32K")
    unit = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[match.group(2)]
    return int(float(match.group(1)) * unit)


def check_quantization_tensor_parallel(
    method: Optional[str], tensor_parallel_size: int, serialized: Optional[bool] = None
) -> None:
    """ValueError when a checkpoint's quantized tensors would be split over tensor-parallel ranks (not supported yet).

    ``method`` is the quantization method (None: unquantized); ``serialized`` says whether the tensors come quantized
    in the checkpoint, as the resolved quantization config knows. Left None (only the ``--quantization`` flag is
    known), the methods that always come quantized in the checkpoint (awq, gptq) are refused.
    """
    if method is None or tensor_parallel_size <= 1:
        return
    if serialized is None:
        serialized = method in CHECKPOINT_QUANTIZATIONS_WITHOUT_TENSOR_PARALLEL
    if serialized:
        raise ValueError(
            f"{method} checkpoints are not sharded across tensor-parallel ranks yet: use --tensor-parallel-size 1"
        )


def _chat_template_flag(value: Optional[str]) -> Optional[str]:
    """--chat-template takes a template or the path of one: a value without braces or newlines is read as a path."""
    if value is None or "{" in value or "\n" in value:
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


@dataclass(slots=True)
class EngineArgs:
    """Everything that configures an engine. ``None`` means "derive a sane default"."""

    model: Optional[str] = option(None, MODEL_HELP, positional=True)
    tokenizer: Optional[str] = option(None, "tokenizer: the same forms as MODEL (default: the model's)")
    revision: Optional[str] = option(
        None, "Hugging Face branch, tag or commit; a commit pins the files (default: main)"
    )
    download_dir: Optional[str] = option(
        None,
        "where downloads go (default: the Hugging Face cache under HF_HOME for Hub models, "
        "$PAGODA_CACHE_DIR/models or ~/.cache/pagoda/models for S3)",
    )
    dtype: str = option("auto", "weights and activations; auto: the checkpoint's dtype", choices=DTYPE_CHOICES)
    device: str = option("auto", "auto: CUDA when available", choices=DEVICE_CHOICES)
    max_model_len: Optional[int] = option(
        None, "default: the model's max_position_embeddings; 32k = 32000, 32K = 32768", type=parse_token_count
    )
    block_size: int = option(DEFAULT_BLOCK_SIZE, "tokens per KV block")
    kv_cache_memory: Union[None, int, str] = option(
        None, "CPU KV cache budget, e.g. 2GiB (default: 4GiB, or less if max-num-seqs full sequences need less)"
    )
    gpu_memory_utilization: float = option(
        DEFAULT_GPU_MEMORY_UTILIZATION, "fraction of GPU memory for weights, activations and KV cache"
    )
    max_num_seqs: int = option(DEFAULT_MAX_NUM_SEQS, "sequences per step")
    max_num_batched_tokens: Optional[int] = option(
        None, f"token budget per step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS} with chunked prefill)"
    )
    enable_prefix_caching: bool = option(True, "reuse cached KV blocks")
    enable_chunked_prefill: bool = option(True, "split long prompts over steps so decodes keep flowing")
    seed: int = option(0, "seeds the engine's RNG (unseeded requests)")
    max_logprobs: int = option(
        DEFAULT_MAX_LOGPROBS,
        "largest logprobs / top_logprobs / prompt_logprobs a request may ask for (as vLLM's); -1: the vocabulary",
    )
    scheduling_policy: str = option(
        "fcfs",
        "fcfs: requests run in arrival order; priority: by the request's priority (lower first, ties by "
        "arrival), and memory pressure preempts the lowest-priority running request",
        choices=SCHEDULING_POLICIES,
    )
    # Inline from Python; on the command line also the path of a template file.
    chat_template: Optional[str] = option(
        None, "a Jinja chat template (file path or inline)", parse=_chat_template_flag
    )
    generation_config: str = option(
        "auto",
        "auto: the model's generation_config.json sets default sampling params; vllm: ignore it; a folder: "
        "the generation_config.json in it instead of the model's",
    )
    attention_backend: str = option(
        "auto", "attention kernels; auto: triton on CUDA, torch on CPU", choices=ATTENTION_BACKENDS
    )
    enforce_eager: bool = option(False, "run every step eagerly (no CUDA graphs for decode steps)")
    quantization: Optional[str] = option(
        None,
        "default: the checkpoint's (config.json quantization_config). awq, gptq: int4/int8 checkpoints; fp8: an "
        "FP8 checkpoint, or FP8 applied at load; int8: weight-only int8 applied at load (CPU)",
        short="-q",
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = option(
        "auto",
        "auto: the model's dtype; fp8_e4m3 / fp8_e5m2: FP8 KV blocks (twice the tokens; per-tensor scales from "
        "the checkpoint, else 1.0); fp8: vLLM's name of fp8_e4m3",
        choices=(*KV_CACHE_DTYPES, "fp8"),
        parse=lambda value: "fp8_e4m3" if value == "fp8" else value,
    )
    structured_output_max_whitespace: int = option(
        0,
        "structured outputs: longest run of free whitespace between JSON tokens; 0 (default): JSON as "
        "json.dumps writes it, which no model can pad with whitespace until max_tokens",
    )
    # What the model serves (see pagoda.pooling): generate text, or pool it into embeddings / relevance scores.
    task: str = option(
        "generate",
        "generate: text (completions, chat); embed: /v1/embeddings; score: /v1/score and /v1/rerank (a reranker "
        "or cross-encoder). No KV cache is built for embed and score",
        choices=TASKS,
    )
    runner: str = option("auto", "vLLM's spelling: pooling is --task embed or score (see --convert)", choices=RUNNERS)
    convert: str = option(
        "auto",
        "vLLM's spelling, with --runner pooling: embed, or classify/score (--task score); auto: the model's "
        "architecture decides (…ForSequenceClassification and rerankers score, others embed)",
        choices=CONVERTS,
    )
    # LoRA adapters (see pagoda.lora): off unless enabled; the slots and caches are sized here.
    enable_lora: bool = option(False, "serve LoRA adapters next to the base model")
    max_loras: int = option(
        DEFAULT_MAX_LORAS, "adapters resident in the device's slots at once; one step never mixes more"
    )
    max_lora_rank: int = option(
        DEFAULT_MAX_LORA_RANK, "the largest adapter rank served (the slots' width): one of 8, 16, 32, 64, 128, 256"
    )
    max_cpu_loras: Optional[int] = option(
        None,
        "adapters kept loaded in host memory (default: max-loras); beyond it the least recently used is "
        "read again from disk when next needed",
    )
    lora_read_timeout: float = option(
        60.0,
        "seconds an adapter's files may take to read (a hung NFS or FUSE mount); past it the load fails, or the "
        "adapter's requests fail with 503 while the others go on",
    )
    tensor_parallel_size: int = option(
        1,
        "split the model over this many devices (CPU: processes sharing the cores), one process each; it must "
        "divide the model's attention heads and intermediate size",
        short="-tp",
    )
    distributed_timeout_seconds: float = option(
        DEFAULT_DISTRIBUTED_TIMEOUT_S,
        "tensor parallelism: a rank that does not reach a collective within this time (dead or hung) stops "
        "the engine, and the server exits non-zero",
    )
    # vLLM's JSON overrides (see pagoda.model_overrides: keys the engine cannot honour are refused at start)
    hf_overrides: Optional[dict] = option(
        None,
        "a JSON object merged over the model's config.json (context length, RoPE, rms_norm_eps, special tokens, "
        "sliding windows; keys that would not match the weights are refused)",
        parse=json_object_flag("--hf-overrides"),
    )
    override_generation_config: Optional[dict] = option(
        None,
        "a JSON object merged over the model's generation_config.json defaults (temperature, top_p, top_k, min_p, "
        "repetition_penalty)",
        parse=json_object_flag("--override-generation-config"),
    )
    kv_events_config: Optional[KVEventsConfig] = option(
        None,
        "vLLM's KV cache events (JSON: enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, "
        "hwm, max_queue_size, topic): the prefix cache's stored and evicted blocks over ZeroMQ (docs/kv-events.md)",
        parse=parse_kv_events_config,
    )

    @property
    def lora_slots(self) -> int:
        """The adapters one step may hold (the device's LoRA slots): ``max_loras`` with LoRA enabled, else 0."""
        return self.max_loras if self.enable_lora else 0

    def resolved_model_path(self) -> Path:
        """The local folder of the model, downloading it first when it is remote (see ``pagoda.model_source``)."""
        from pagoda.model_source import resolve_model

        return resolve_model(self.model, self.revision, self.download_dir, builtin=builtin_model_path())

    def with_local_paths(self) -> EngineArgs:
        """A copy whose model and tokenizer are local folders (downloaded now if remote): resolve once, reuse."""
        from pagoda.model_source import resolve_model

        tokenizer = None if self.tokenizer is None else str(resolve_model(self.tokenizer, None, self.download_dir))
        return replace(self, model=str(self.resolved_model_path()), tokenizer=tokenizer, revision=None)

    def validate(self) -> None:
        """Check the values that do not depend on the model."""
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two between 1 and 128, got {self.block_size}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or at least 0, got {self.max_logprobs}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.generation_config not in GENERATION_CONFIGS and not Path(self.generation_config).is_dir():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported (supported: {', '.join(QUANTIZATIONS)})"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.structured_output_max_whitespace < 0:
            raise ValueError(
                f"structured_output_max_whitespace must be >= 0, got {self.structured_output_max_whitespace}"
            )
        self._validate_lora()
        self._validate_parallelism()
        check_overrides(self.hf_overrides, self.override_generation_config)
        self.kv_events_config = parse_kv_events_config(self.kv_events_config)  # LLM(kv_events_config={...}) too
        check_kv_events(self.kv_events_config, self.enable_prefix_caching)
        self._validate_task()
        if self.hf_overrides and self.task != "generate":  # after --runner/--convert set the task
            raise ValueError(f"--hf-overrides is not supported with --task {self.task} yet (text generation only)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")

    def _validate_parallelism(self) -> None:
        if not 1 <= self.tensor_parallel_size <= TENSOR_PARALLEL_MAX:
            raise ValueError(
                f"tensor_parallel_size must be between 1 and {TENSOR_PARALLEL_MAX}, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size > 1 and self.enable_lora:
            raise ValueError(
                "LoRA adapters are not served with tensor parallelism yet: use --tensor-parallel-size 1 with "
                "--enable-lora"
            )
        check_quantization_tensor_parallel(self.quantization, self.tensor_parallel_size)
        if self.distributed_timeout_seconds <= 0:
            raise ValueError(f"distributed_timeout_seconds must be positive, got {self.distributed_timeout_seconds}")

    def _validate_task(self) -> None:
        """Map vLLM's ``--runner pooling`` / ``--convert`` onto ``task``; refuse spellings that contradict it."""
        for name, choices in (("task", TASKS), ("runner", RUNNERS), ("convert", CONVERTS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        converted = {"embed": "embed", "classify": "score", "score": "score"}.get(self.convert)
        pooling = self.runner == "pooling" or converted is not None
        if self.runner == "generate" and (self.task != "generate" or converted is not None):
            raise ValueError("--runner generate serves text: drop --task/--convert, or use --runner pooling")
        if pooling and self.task != "generate" and converted not in (None, self.task):
            raise ValueError(f"--convert {self.convert} contradicts --task {self.task}")
        if pooling and self.task == "generate":
            # --convert auto: embed unless the architecture says score (see pagoda.pooling.resolve_task).
            self.task = converted or "embed"

    def _validate_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))}, got {self.max_lora_rank}"
            )
        if not self.lora_read_timeout > 0:
            raise ValueError(f"lora_read_timeout must be greater than 0, got {self.lora_read_timeout}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits the scheduler plans under."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    max_loras: int = 0  # distinct adapters one step may hold; 0: LoRA is off
    scheduling_policy: str = "fcfs"  # fcfs or priority (see pagoda.core.request_queue)

    @staticmethod
    def from_args(args: EngineArgs, max_model_len: int) -> SchedulerConfig:
        budget = args.max_num_batched_tokens
        if budget is None:
            budget = (
                DEFAULT_MAX_NUM_BATCHED_TOKENS
                if args.enable_chunked_prefill
                else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
            )
        if not args.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({budget}) must be at least "
                f"max_model_len ({max_model_len}) so that every prompt fits in one step"
            )
        return SchedulerConfig(
            args.max_num_seqs,
            budget,
            max_model_len,
            args.enable_chunked_prefill,
            args.lora_slots,
            args.scheduling_policy,
        )
