"""Rank 0's side of tensor parallelism: start the worker processes, send each step to them, watch them.

The engine process is rank 0: it keeps the scheduler, the KV-cache manager and the sampler and runs its own
shard of the model. Ranks 1..N-1 are spawned processes (:mod:`pagoda.executor.worker_process`). A step's plan reaches
them as one pickled message on a pipe per worker (measured against a gloo ``broadcast_object_list`` in
``benchmarks/tp_compare.py``: the pipe is faster and, unlike a collective, may wait without a timeout while the
server idles); tensors move only in the model's collectives. A worker that dies is reported by the watchdog (which
also aborts the CPU shared-memory exchange, and wakes an idle engine) and breaks gloo's connections; a hung one
makes rank 0's next collective fail after ``timeout_s``. On GPUs, where rank 0 may wait on the device instead, the
async engine's grace timer declares the engine dead (see ``AsyncLLMEngine._worker_died``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Optional

import torch

from pagoda.distributed.errors import WorkerDiedError
from pagoda.distributed.parallel import TensorParallel, init_tensor_parallel
from pagoda.distributed.shm_comm import ShmCommunicator, segment_path, shared_memory_enabled, slot_bytes_for
from pagoda.executor.worker_process import WorkerSpec, run_worker
from pagoda.worker.worker import device_for_rank
from pagoda.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

_JOIN_S = 10.0
# Below the default Unix-socket send buffer (212,992 bytes on Linux), so such a send returns at once.
_SEND_INLINE_BYTES = 128 * 1024


class WorkerGroup:
    """The processes of ranks 1..N-1 and the pipes that carry rank 0's commands to them."""

    def __init__(self, spec: WorkerSpec) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or OpenMP state
        # Created before any worker starts, so that each can map it as it joins.
        self.shm = _create_segment(spec)
        if self.shm is None:
            spec = replace(spec, shm_path=None)
        self.spec = spec
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._pipes = []
        for rank in range(1, spec.world_size):
            ours, theirs = context.Pipe(duplex=True)
            process = context.Process(
                target=run_worker, args=(spec, rank, theirs), name=f"pagoda-tp-rank-{rank}", daemon=True
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self._pipes.append(ours)
        # This process is rank 0: on CPU it gets its share of the cores too (given back at shutdown).
        self._threads_before = torch.get_num_threads()
        if spec.worker.device_type == "cpu":
            torch.set_num_threads(spec.num_threads)
        self.error: Optional[WorkerDiedError] = None
        self._listeners: list[Callable[[BaseException], None]] = []
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._watchdog = threading.Thread(target=self._watch, name="pagoda-tp-watchdog", daemon=True)
        self._watchdog.start()
        for rank, process in enumerate(self.processes, start=1):
            logger.info("tensor-parallel rank %d runs in pid %d", rank, process.pid)

    def join_group(self, device: torch.device) -> TensorParallel:
        """Join the process group as rank 0, once every worker is about to (a spawned process takes seconds to
        import torch, more on a busy host: that wait has no timeout, only the workers' deaths end it early)."""
        self._wait_for_every_worker(b"joining", "starting")
        return init_tensor_parallel(
            0,
            self.spec.world_size,
            self.spec.init_method,
            device_for_rank(device.type, 0),
            self.spec.timeout_s,
            self.shm,
        )

    def wait_until_loaded(self) -> None:
        """Block until every worker has loaded its shard (loading may take longer than any collective timeout, so
        no collective runs before); WorkerDiedError if one ends first."""
        self._wait_for_every_worker(b"ready", "loading its shard")
        if self.shm is not None:
            self.shm.unlink()  # every rank has it mapped: no file to leak, whatever happens next
        logger.info("every tensor-parallel worker has loaded its shard")

    def _wait_for_every_worker(self, message: bytes, doing: str) -> None:
        pending = {pipe: rank for rank, pipe in enumerate(self._pipes, start=1)}
        sentinels = {process.sentinel: process for process in self.processes}
        while pending:
            for ready in wait([*pending, *sentinels]):
                if ready in sentinels:
                    process = sentinels[ready]
                    raise WorkerDiedError(f"{process.name} exited with code {process.exitcode} while {doing}")
                try:
                    received = ready.recv_bytes()
                except EOFError as exc:
                    raise WorkerDiedError(f"tensor-parallel worker {pending[ready]} exited while {doing}") from exc
                assert received == message, (received, message)
                del pending[ready]

    def add_death_listener(self, listener: Callable[[BaseException], None]) -> None:
        """``listener(error)`` runs once, on the watchdog thread, when a worker ends unexpectedly."""
        self._listeners.append(listener)
        if self.error is not None:
            listener(self.error)

    def broadcast(self, method: str, args: tuple) -> None:
        """Send ``(method, args)`` to every worker (they run it in order, in lockstep with rank 0)."""
        if self.error is not None:
            raise self.error
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            for rank, pipe in enumerate(self._pipes, start=1):
                try:
                    self._send(pipe, message)
                except OSError as exc:  # BrokenPipeError: the worker is gone
                    raise WorkerDiedError(f"tensor-parallel worker {rank} is gone: {exc}") from exc

    def _send(self, pipe: Connection, message: bytes) -> None:
        """A message that fits the socket buffer never blocks; a larger one (a plan with long block tables) is sent
        from a thread, so that a worker that stopped reading fails the step after the timeout instead of holding
        rank 0 in the write forever."""
        if len(message) <= _SEND_INLINE_BYTES:
            pipe.send_bytes(message)
            return
        failure: list[BaseException] = []

        def send() -> None:
            try:
                pipe.send_bytes(message)
            except BaseException as exc:
                failure.append(exc)

        sender = threading.Thread(target=send, name="pagoda-tp-send", daemon=True)
        sender.start()
        sender.join(self.spec.timeout_s)
        if sender.is_alive():
            raise WorkerDiedError(f"a tensor-parallel worker did not read its step within {self.spec.timeout_s:.0f} s")
        if failure:
            raise failure[0]

    def poison(self, reason: str) -> None:
        """Rank 0 failed between sending a command and finishing it: the ranks are out of step for good, so no
        later command may run (each would pair rank 0's collectives with the workers' previous ones). Stop them."""
        if self.error is None:
            self.error = WorkerDiedError(f"tensor-parallel ranks out of step: {reason}")
        logger.error("%s; stopping the workers", self.error)
        self.shutdown(grace_s=1.0)  # they may be hung: do not wait long

    def shutdown(self, grace_s: float = _JOIN_S) -> None:
        """Stop the workers (a stop message, then SIGKILL for any that have not exited within ``grace_s``)."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.shm is not None:
            self.shm.abort()  # a worker waiting in an exchange (rank 0 gone from it) stops waiting
        stop = pickle.dumps(None)
        if self._lock.acquire(timeout=grace_s):  # never interleave with a half-written step
            for pipe in self._pipes:
                with contextlib.suppress(OSError):  # an exited worker needs no stop message
                    pipe.send_bytes(stop)
            self._lock.release()
        for pipe in self._pipes:
            pipe.close()
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
        torch.set_num_threads(self._threads_before)
        if self.shm is not None:
            self.shm.unlink()
            self.shm.close()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # a group broken by a dead peer cannot always be torn down cleanly
            logger.debug("destroying the process group failed", exc_info=True)

    def _watch(self) -> None:
        sentinels = {process.sentinel: process for process in self.processes}
        ended = wait(list(sentinels))
        if self._closing.is_set():
            return
        process = sentinels[ended[0]]
        process.join(1)
        self.error = WorkerDiedError(
            f"tensor-parallel worker {process.name} (pid {process.pid}) exited with code {process.exitcode}"
        )
        logger.critical("%s; the engine cannot continue", self.error)
        if self.shm is not None:
            self.shm.abort()  # a rank waiting in a shared-memory exchange stops waiting
        for listener in self._listeners:
            try:
                listener(self.error)
            except Exception:
                logger.exception("a worker-death listener failed")


def worker_spec(worker: WorkerConfig, world_size: int, timeout_s: float, largest_collective_bytes: int) -> WorkerSpec:
    """The spec every worker starts from: a fresh loopback rendezvous port, each rank's share of the cores, and
    on CPU a shared-memory segment whose slots hold ``largest_collective_bytes``."""
    cpu = worker.device_type == "cpu"
    return WorkerSpec(
        worker=worker,
        world_size=world_size,
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        shm_path=segment_path() if cpu and shared_memory_enabled() else None,
        shm_slot_bytes=slot_bytes_for(largest_collective_bytes),
        timeout_s=timeout_s,
        num_threads=cpu_threads_per_rank(world_size),
        log_level=logging.getLogger("pagoda").getEffectiveLevel(),
        parent_pid=os.getpid(),
    )


def _create_segment(spec: WorkerSpec) -> Optional[ShmCommunicator]:
    if spec.shm_path is None:
        return None
    try:
        return ShmCommunicator(spec.shm_path, 0, spec.world_size, spec.timeout_s, spec.shm_slot_bytes)
    except OSError as exc:  # e.g. a container's 64 MiB /dev/shm
        logger.warning("no shared memory for the tensor-parallel collectives (%s); using gloo for all of them", exc)
        return None


def cpu_threads_per_rank(world_size: int) -> int:
    """This process's torch threads split evenly over the ranks (at least one each). torch's count already honours
    ``OMP_NUM_THREADS`` (which the operator sets from the pod's CPU limit) and the CPU affinity."""
    return max(1, torch.get_num_threads() // world_size)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
