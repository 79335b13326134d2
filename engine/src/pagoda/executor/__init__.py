"""Executors: run the model on one rank in this process, or on N tensor-parallel ranks in N processes.

The engine talks only to an :class:`~pagoda.executor.base.Executor` (see there for the interface); the executor
owns the workers, their processes, their death listeners and shutdown. :func:`create_executor` picks the kind.
"""

from __future__ import annotations

from pagoda.executor.base import CacheConfig, Executor, ParallelConfig
from pagoda.worker.worker_config import WorkerConfig


def create_executor(worker: WorkerConfig, parallel: ParallelConfig, cache: CacheConfig) -> Executor:
    """Start the workers (loading the model on every rank) and allocate the KV cache; a failure stops them again."""
    if parallel.tensor_parallel_size > 1:
        from pagoda.executor.multiproc import MultiprocExecutor

        executor: Executor = MultiprocExecutor(worker, parallel, cache)
    else:
        from pagoda.executor.uniproc import UniProcExecutor

        executor = UniProcExecutor(worker, parallel, cache)
    try:
        executor.initialize_kv_cache()
    except BaseException:
        executor.shutdown()
        raise
    return executor


__all__ = ["CacheConfig", "Executor", "ParallelConfig", "create_executor"]
