"""Build rank 0's model runner (and, under tensor parallelism, the other ranks) and size the KV cache."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagoda.config import EngineArgs, SchedulerConfig
from pagoda.distributed.executor import WorkerGroup, worker_spec
from pagoda.distributed.parallel import SINGLE, TensorParallel, check_shardable
from pagoda.lora.manager import LoRASettings
from pagoda.model_config import ModelConfig
from pagoda.worker.kv_sizing import check_fits, cpu_num_blocks
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def start_model_runner(
    args: EngineArgs,
    model_config: ModelConfig,
    model_path: Path,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str,
    scheduler_config: SchedulerConfig,
    max_model_len: int,
) -> tuple[ModelRunner, int]:
    """Rank 0's runner with its KV cache allocated (on every rank), and the number of KV blocks.

    With ``--tensor-parallel-size N`` > 1 the N-1 worker processes start first and load their shards while this
    process loads its own; any failure stops them again.
    """
    lora = (
        LoRASettings(args.max_loras, args.max_lora_rank, args.max_cpu_loras, args.download_dir)
        if args.enable_lora
        else None
    )
    workers = None
    tp: TensorParallel = SINGLE
    try:
        if args.tensor_parallel_size > 1:
            workers = _start_workers(args, model_config, model_path, device, dtype, attention_backend, scheduler_config)
            tp = workers.join_group(device)
        runner = ModelRunner(
            model_config,
            model_path,
            dtype,
            device,
            attention_backend,
            quantization=args.quantization,
            lora=lora,
            tp=tp,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        if workers is not None:
            workers.wait_until_loaded()
            runner.workers = workers
        num_blocks = _size_and_allocate(runner, args, device, attention_backend, scheduler_config, max_model_len)
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise
    return runner, num_blocks


def _start_workers(
    args: EngineArgs,
    model_config: ModelConfig,
    model_path: Path,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str,
    scheduler_config: SchedulerConfig,
) -> WorkerGroup:
    size = args.tensor_parallel_size
    check_shardable(model_config, size)  # before any process starts
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
    # The largest collectives: a full chunk's all-reduce, and the logits gather of a full decode batch.
    element = torch.tensor([], dtype=dtype).element_size()
    all_reduce = scheduler_config.max_num_batched_tokens * model_config.hidden_size * element
    gather = scheduler_config.max_num_seqs * -(-model_config.vocab_size // size) * 4
    spec = worker_spec(
        model_config,
        str(model_path),
        dtype,
        device,
        attention_backend,
        args.quantization,
        args.kv_cache_dtype,
        size,
        args.distributed_timeout_seconds,
        max(all_reduce, gather),
    )
    return WorkerGroup(spec)


def _size_and_allocate(
    runner: ModelRunner,
    args: EngineArgs,
    device: torch.device,
    attention_backend: str,
    scheduler_config: SchedulerConfig,
    max_model_len: int,
) -> int:
    shape = runner.kv_cache_shape(args.block_size)
    if device.type == "cpu":
        num_blocks = cpu_num_blocks(shape, args.kv_cache_memory, args.max_num_seqs, max_model_len)
        check_fits(num_blocks, shape, max_model_len, "raise --kv-cache-memory")
    else:
        profile_tokens = min(scheduler_config.max_num_batched_tokens, max_model_len)
        num_blocks = runner.on_all_ranks("measure_kv_blocks", shape, args.gpu_memory_utilization, profile_tokens)
        check_fits(num_blocks, shape, max_model_len, "raise --gpu-memory-utilization")
    runner.on_all_ranks("allocate_kv_cache", shape, num_blocks)
    if device.type == "cuda" and attention_backend == "triton" and not args.enforce_eager:
        runner.on_all_ranks("capture_cuda_graphs", args.max_num_seqs, max_model_len)
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB per rank x %d, %s); %.1f sequences of "
        "max_model_len=%d fit",
        num_blocks,
        shape.block_size,
        num_blocks * shape.block_size,
        num_blocks * shape.bytes_per_block / 2**20,
        shape.num_ranks,
        shape.dtype,
        num_blocks * shape.block_size / max_model_len,
        max_model_len,
    )
    return num_blocks
