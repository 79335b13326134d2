"""The interface the engine runs the model through, and what every executor shares: one step, KV sizing, LoRA.

A step crosses the executor in three moves: the rank-0 worker prepares it (:meth:`Worker.prepare_step`: tokens,
block tables, the LoRA slots), every rank runs its forward (:meth:`Executor.collective_rpc` of ``run_forward``,
the one place where executors differ), and rank 0 samples (:meth:`Worker.sample`). A speculative decoder plugs in
at this boundary: a proposer adds draft rows to the prepared step, and sampling verifies them.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagoda.lora.adapter import LoRAAdapter
from pagoda.worker.kv_sizing import check_fits, cpu_num_blocks
from pagoda.worker.worker import Worker
from pagoda.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many tensor-parallel ranks, and how long a collective waits for a slow one (the defaults are
    :class:`~pagoda.config.EngineArgs`'s; :class:`~pagoda.engine.engine_config.EngineConfig` fills every field)."""

    tensor_parallel_size: int
    timeout_s: float  # --distributed-timeout-seconds
    largest_collective_bytes: int  # what one rank's shared-memory slot must hold (CPU)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How the KV cache is sized, and the limits it must serve."""

    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: Optional[int]  # CPU budget in bytes (None: what max_num_seqs full sequences use, <= 4 GiB)
    gpu_memory_utilization: float
    enforce_eager: bool  # no CUDA graphs


class Executor(ABC):
    """Owns the workers of every rank: runs steps on them, sizes their KV cache, and stops them.

    ``driver_worker`` is rank 0's worker, in this process; it keeps the requests' sampling state.
    """

    driver_worker: Worker

    def __init__(self, worker: WorkerConfig, parallel: ParallelConfig, cache: CacheConfig) -> None:
        self.worker_config = worker
        self.parallel = parallel
        self.cache = cache
        self.num_blocks = 0

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> Any:
        """Run ``Worker.<method>(*args)`` on every rank and return rank 0's result (methods that may run
        collectives: :data:`pagoda.worker.worker.COLLECTIVE_METHODS`)."""

    @abstractmethod
    def add_death_listener(self, listener: Callable[[BaseException], None]) -> None:
        """``listener(error)`` runs once (on another thread) if a worker process dies: the engine can then make no
        progress. An executor without worker processes never calls it."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the worker processes, if any (idempotent; no step may run afterwards)."""

    # ---- steps ---------------------------------------------------------------------------------------

    def execute_model(self, plan: SchedulerOutput, adapters: Mapping[int, LoRAAdapter]) -> ModelRunnerOutput:
        """Run one scheduled step on every rank and sample it. ``adapters``: the weights of the step's adapters
        that no device slot holds (see :meth:`resident_loras`)."""
        driver = self.driver_worker
        prepared = driver.prepare_step(plan, adapters)
        try:
            logits = self.collective_rpc("run_forward", prepared.forward)
        finally:
            driver.end_step()
        return driver.sample(prepared, logits)

    # ---- LoRA device slots (rank 0: adapters are not sharded) -----------------------------------------

    def lora_targets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """layer name -> (in_features, output slices): what an adapter's tensors must fit."""
        return self.driver_worker.lora_targets()

    def resident_loras(self) -> frozenset[int]:
        """The adapters whose weights are in a device slot now (a step needs no host copy of these)."""
        return self.driver_worker.resident_loras()

    def remove_loras(self, lora_ids: list[int]) -> None:
        """Empty the slots of adapters the engine no longer serves."""
        self.driver_worker.remove_loras(lora_ids)

    # ---- KV cache --------------------------------------------------------------------------------------

    def initialize_kv_cache(self) -> int:
        """Size the KV cache (CPU: the byte budget; GPU: what the device holds after a profiled forward, the
        smallest over the ranks), allocate it on every rank, capture CUDA graphs; returns the number of blocks."""
        cache = self.cache
        shape = self.driver_worker.kv_cache_shape(cache.block_size)
        if self.worker_config.device_type == "cpu":
            num_blocks = cpu_num_blocks(shape, cache.kv_cache_memory, cache.max_num_seqs, cache.max_model_len)
            check_fits(num_blocks, shape, cache.max_model_len, "raise --kv-cache-memory")
        else:
            profile_tokens = min(cache.max_num_batched_tokens, cache.max_model_len)
            num_blocks = self.collective_rpc("measure_kv_blocks", shape, cache.gpu_memory_utilization, profile_tokens)
            check_fits(num_blocks, shape, cache.max_model_len, "raise --gpu-memory-utilization")
        self.collective_rpc("allocate_kv_cache", shape, num_blocks)
        uses_graphs = self.worker_config.device_type == "cuda" and self.worker_config.attention_backend == "triton"
        if uses_graphs and not cache.enforce_eager:
            self.collective_rpc("capture_cuda_graphs", cache.max_num_seqs, cache.max_model_len)
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB per rank x %d, %s); %.1f sequences of "
            "max_model_len=%d fit",
            num_blocks,
            shape.block_size,
            num_blocks * shape.block_size,
            num_blocks * shape.bytes_per_block / 2**20,
            shape.num_ranks,
            shape.dtype,
            num_blocks * shape.block_size / cache.max_model_len,
            cache.max_model_len,
        )
        self.num_blocks = num_blocks
        return num_blocks
