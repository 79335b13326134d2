"""Everything an engine derives from its arguments, resolved and checked once before any weight is read.

``resolve_engine_config`` downloads a remote model (or finds it in the cache), reads its ``config.json`` and
quantization config, picks device, dtype, context length and attention backend, and refuses contradictions (a
quantization the checkpoint or the device cannot run, a model tensor parallelism cannot split) in seconds, not
after minutes of loading. The result hands each layer below the part it needs: the scheduler its limits, the
executor its parallel and cache settings, every rank's worker its :class:`WorkerConfig`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pagoda.attention.choice import resolve_attention_backend
from pagoda.config import EngineArgs, SchedulerConfig, check_quantization_tensor_parallel
from pagoda.distributed.parallel import check_shardable
from pagoda.executor import CacheConfig, ParallelConfig
from pagoda.layers.linear_kernels import validate_quantization
from pagoda.model_config import ModelConfig, resolve_dtype
from pagoda.model_overrides import apply_overrides
from pagoda.models.registry import get_model_class
from pagoda.quantization.loading import quant_config_for
from pagoda.worker.worker_config import LoRASlotConfig, WorkerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """The resolved configuration of one engine (``args`` with local paths)."""

    args: EngineArgs
    model_path: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    attention_backend: str  # resolved: torch | triton
    scheduler: SchedulerConfig
    quantized_experts: bool = False  # a mixture of experts whose experts are quantized: see eager_reason

    @property
    def worker(self) -> WorkerConfig:
        slots = self.args.lora_slots
        lora = LoRASlotConfig(slots, self.args.max_lora_rank) if slots else None
        return WorkerConfig(
            model_config=self.model_config,
            model_path=self.model_path,
            dtype=self.dtype,
            device_type=self.device.type,
            attention_backend=self.attention_backend,
            quantization=self.args.quantization,
            kv_cache_dtype=self.args.kv_cache_dtype,
            lora=lora,
        )

    @property
    def parallel(self) -> ParallelConfig:
        size = self.args.tensor_parallel_size
        # The largest collectives: a full chunk's all-reduce, and the logits gather of a full decode batch.
        element = torch.tensor([], dtype=self.dtype).element_size()
        all_reduce = self.scheduler.max_num_batched_tokens * self.model_config.hidden_size * element
        gather = self.scheduler.max_num_seqs * -(-self.model_config.vocab_size // size) * 4
        return ParallelConfig(size, self.args.distributed_timeout_seconds, max(all_reduce, gather))

    @property
    def cache(self) -> CacheConfig:
        args = self.args
        return CacheConfig(
            block_size=args.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.scheduler.max_num_seqs,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=eager_reason(
                args.enforce_eager, args.tensor_parallel_size, self.device, self.quantized_experts
            )
            is not None,
        )


def resolve_engine_config(args: EngineArgs) -> EngineConfig:
    """Validate ``args``, fetch the model if it is remote, and derive everything the engine runs with."""
    args.validate()
    args = args.with_local_paths()
    model_path = Path(args.model)
    model_config = ModelConfig.from_model_dir(model_path)
    model_config = apply_overrides(
        model_config, args.hf_overrides, args.override_generation_config, args.generation_config
    )
    model_cls = get_model_class(model_config.architecture)  # an architecture Pagoda lacks fails before any loading
    device = resolve_device(args.device)
    # A flag the checkpoint contradicts, or a method this device lacks, fails before minutes of weight loading.
    quant = quant_config_for(model_path, args.quantization)
    validate_quantization(quant.method if quant is not None else None, device)
    if quant is not None:
        check_quantization_tensor_parallel(quant.method, args.tensor_parallel_size, quant.serialized)
    if args.tensor_parallel_size > 1:
        check_shardable(model_config, args.tensor_parallel_size)  # before any process starts
        family_check = getattr(model_cls, "check_tensor_parallel", None)  # e.g. expert widths, MXFP4 groups
        if family_check is not None:
            family_check(model_config, args.tensor_parallel_size)
    dtype = resolve_dtype(args.dtype, model_config, device)
    if quant is not None and device.type == "cpu" and args.dtype == "auto" and dtype == torch.float16:
        # AWQ/GPTQ checkpoints are mostly float16; the CPU's quantized kernels take bfloat16 activations.
        logger.info("quantized float16 checkpoint on CPU: running in bfloat16 (pass --dtype to override)")
        dtype = torch.bfloat16
    max_model_len = resolve_max_model_len(args.max_model_len, model_config)
    backend = resolve_attention_backend(args.attention_backend, device)
    logger.info("attention backend: %s (%s)", backend, args.attention_backend)
    # Quantized experts (AWQ, GPTQ, FP8, gpt-oss's MXFP4) run per expert, which reads the routing back to the host.
    quantized_experts = getattr(model_cls, "routed_experts", False) and (
        quant is not None or "quantization_config" in model_config.raw
    )
    reason = eager_reason(args.enforce_eager, args.tensor_parallel_size, device, quantized_experts)
    if reason is not None and not args.enforce_eager:
        logger.info("decode steps run eagerly, without CUDA graphs: %s", reason)
    return EngineConfig(
        args=args,
        model_path=model_path,
        model_config=model_config,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        attention_backend=backend,
        scheduler=SchedulerConfig.from_args(args, max_model_len),
        quantized_experts=quantized_experts,
    )


def eager_reason(
    enforce_eager: bool, tensor_parallel_size: int, device: torch.device, quantized_experts: bool = False
) -> Optional[str]:
    """Why decode steps run without CUDA graphs, or None when they are captured (CUDA only: the Triton backend).

    ``--enforce-eager``, or tensor parallelism on a GPU: a captured decode step would hold NCCL all-reduces, and
    no GPU run has shown those to replay correctly yet. There is deliberately no flag that asks for graphs with
    ``tensor_parallel_size > 1``: lift this rule (and test it on GPUs) rather than offering an unverified mode.
    Quantized mixture-of-experts layers run expert by expert over the tokens routed to each, which reads the
    routing back to the host: a graph cannot capture that (dense experts take the fused MoE kernel, which can).
    """
    if enforce_eager:
        return "--enforce-eager"
    if torch.device(device).type == "cuda" and quantized_experts:
        return "the experts are quantized: they run one by one over their routed tokens, which a graph cannot hold"
    if torch.device(device).type == "cuda" and tensor_parallel_size > 1:
        return (
            f"tensor_parallel_size={tensor_parallel_size}: capturing NCCL all-reduces in CUDA graphs is not verified "
            "on GPUs yet"
        )
    return None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    return torch.device(device)


def resolve_max_model_len(requested: Optional[int], config: ModelConfig) -> int:
    limit = config.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} is larger than the model's max_position_embeddings={limit}")
    return requested
