"""The executor of one rank: the model runs in this process, and nothing needs broadcasting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagoda.distributed.parallel import SINGLE
from pagoda.executor.base import CacheConfig, Executor, ParallelConfig
from pagoda.worker.worker import Worker
from pagoda.worker.worker_config import WorkerConfig


class UniProcExecutor(Executor):
    """One worker, rank 0 of a group of one, in the engine's process."""

    def __init__(self, worker: WorkerConfig, parallel: ParallelConfig, cache: CacheConfig) -> None:
        assert parallel.tensor_parallel_size == 1, parallel
        super().__init__(worker, parallel, cache)
        self.driver_worker = Worker(worker, torch.device(worker.device_type), SINGLE)

    def collective_rpc(self, method: str, *args: Any) -> Any:
        return getattr(self.driver_worker, method)(*args)

    def add_death_listener(self, listener: Callable[[BaseException], None]) -> None:
        """No worker process can die apart from this one: the listener is never called."""

    def shutdown(self) -> None:
        """Nothing to stop: the model lives and goes with this process."""
