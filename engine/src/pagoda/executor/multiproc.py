"""The executor of N tensor-parallel ranks: rank 0 in the engine's process, ranks 1..N-1 in spawned processes.

Every collective method reaches the other ranks first, as one message on each worker's pipe
(:class:`~pagoda.executor.worker_group.WorkerGroup`), then runs on rank 0's own worker. A failure between the two
leaves the ranks out of step for good, so it stops the group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from pagoda.distributed.errors import WorkerDiedError
from pagoda.executor.base import CacheConfig, Executor, ParallelConfig
from pagoda.executor.worker_group import WorkerGroup, worker_spec
from pagoda.worker.worker import Worker
from pagoda.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


class MultiprocExecutor(Executor):
    """Starts the N-1 worker processes, which load their shards while this process loads rank 0's."""

    def __init__(self, worker: WorkerConfig, parallel: ParallelConfig, cache: CacheConfig) -> None:
        super().__init__(worker, parallel, cache)
        size = parallel.tensor_parallel_size
        if worker.device_type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        spec = worker_spec(worker, size, parallel.timeout_s, parallel.largest_collective_bytes)
        self.workers = WorkerGroup(spec)
        try:
            device = torch.device(worker.device_type)
            tp = self.workers.join_group(device)
            self.driver_worker = Worker(worker, device, tp)
            self.workers.wait_until_loaded()
        except BaseException:
            self.workers.shutdown()
            raise

    def collective_rpc(self, method: str, *args: Any) -> Any:
        self.workers.broadcast(method, args)
        try:
            return getattr(self.driver_worker, method)(*args)
        except BaseException as exc:  # a collective failed (a rank died or hung), or rank 0 itself (Ctrl-C, a bug)
            # The workers may be a collective ahead now: nothing may run on these ranks again.
            self.workers.poison(f"rank 0 failed during {method}: {exc!r}")
            if isinstance(exc, RuntimeError) and not isinstance(exc, WorkerDiedError):
                raise WorkerDiedError(f"tensor parallelism failed during {method}: {exc}") from exc
            raise

    def add_death_listener(self, listener: Callable[[BaseException], None]) -> None:
        self.workers.add_death_listener(listener)

    def shutdown(self) -> None:
        self.workers.shutdown()
