"""Engine arguments (what a user sets, named like vLLM's flags) and their validation."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Optional, Union

from pagoda.capabilities import (
    CHECKPOINT_QUANTIZATIONS_WITHOUT_TENSOR_PARALLEL,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    KV_CACHE_DTYPES,
    LORA_RANKS,
    QUANTIZATION_DEVICES,
)

DEFAULT_BLOCK_SIZE = 16
# awq, gptq, fp8, int8 (see pagoda.quantization); the devices of each are in pagoda.capabilities
QUANTIZATIONS = tuple(QUANTIZATION_DEVICES)
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 1024**3
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
# How long a collective waits for a slow rank before the engine gives up on it (a dead or hung worker).
DEFAULT_DISTRIBUTED_TIMEOUT_S = 60.0

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2}
_SIZE_UNITS |= {"g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def builtin_model_path() -> Path:
    """The bundled stories260K checkpoint (MIT, see its README)."""
    return Path(str(resources.files("pagoda") / "assets" / "models" / "stories260K"))


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


@dataclass(slots=True)
class EngineArgs:
    """Everything that configures an engine. ``None`` means "derive a sane default"."""

    model: Optional[str] = None  # local dir, HF id (org/name, hf://), s3://bucket/prefix; None: built-in stories260K
    tokenizer: Optional[str] = None  # the same forms; None: the model's
    revision: Optional[str] = None  # Hugging Face branch, tag or commit (a commit pins it)
    download_dir: Optional[str] = None  # where downloads go (default: the Hugging Face cache, ~/.cache/pagoda/models)
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: Optional[int] = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: Union[None, int, str] = None  # CPU KV budget in bytes (default 4 GiB or what is needed)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    chat_template: Optional[str] = None
    generation_config: str = "auto"  # auto: the model's generation_config.json supplies defaults; vllm: ignore it
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    enforce_eager: bool = False  # True: never capture CUDA graphs (every step runs eagerly)
    # None: the checkpoint's own (config.json's quantization_config), else unquantized | awq | gptq | fp8 | int8
    quantization: Optional[str] = None
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8_e4m3 | fp8_e5m2 (per-tensor scales)
    # Structured outputs: the longest run of whitespace a JSON output may hold between tokens (0: compact JSON).
    structured_output_max_whitespace: int = 0
    # LoRA adapters (see pagoda.lora): off unless enabled; the slots and caches are sized here.
    enable_lora: bool = False
    max_loras: int = DEFAULT_MAX_LORAS  # adapters resident at once (and the most one step may mix)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: Optional[int] = None  # adapters kept in host memory; None: max_loras
    # Tensor parallelism: one model over this many devices (CPU: processes), one worker process per extra rank.
    tensor_parallel_size: int = 1
    # A collective that waits longer than this for a rank (dead or hung) fails, and the engine with it.
    distributed_timeout_seconds: float = DEFAULT_DISTRIBUTED_TIMEOUT_S

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
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
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
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")

    def _validate_parallelism(self) -> None:
        from pagoda.capabilities import TENSOR_PARALLEL_MAX

        if not 1 <= self.tensor_parallel_size <= TENSOR_PARALLEL_MAX:
            raise ValueError(
                f"tensor_parallel_size must be between 1 and {TENSOR_PARALLEL_MAX}, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size > 1 and self.enable_lora:
            raise ValueError(
                "LoRA adapters are not served with tensor parallelism yet: use --tensor-parallel-size 1 with "
                "--enable-lora"
            )
        if self.tensor_parallel_size > 1 and self.quantization in CHECKPOINT_QUANTIZATIONS_WITHOUT_TENSOR_PARALLEL:
            raise ValueError(
                f"{self.quantization} checkpoints are not sharded across tensor-parallel ranks yet: use "
                "--tensor-parallel-size 1"
            )
        if self.distributed_timeout_seconds <= 0:
            raise ValueError(f"distributed_timeout_seconds must be positive, got {self.distributed_timeout_seconds}")

    def _validate_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))}, got {self.max_lora_rank}"
            )
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
        max_loras = args.max_loras if args.enable_lora else 0
        return SchedulerConfig(args.max_num_seqs, budget, max_model_len, args.enable_chunked_prefill, max_loras)
