"""The loop of a tensor-parallel rank other than 0: load this rank's shard, then run what rank 0 broadcasts."""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional

import torch

from pagoda.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build its rank (pickled to the spawned process)."""

    worker: WorkerConfig  # the model, dtype, device kind, backend: the same on every rank
    world_size: int
    init_method: str  # tcp://127.0.0.1:<port>, rank 0's rendezvous
    shm_path: Optional[str]  # CPU: the shared-memory segment rank 0 created for the collectives (None: gloo only)
    shm_slot_bytes: int  # each rank's slot in it: the largest collective that goes through shared memory
    timeout_s: float  # every collective's limit
    num_threads: int  # torch intra-op threads of each rank on CPU
    log_level: int
    parent_pid: int  # rank 0's process: the worker exits when it is gone


def run_worker(spec: WorkerSpec, rank: int, commands: Connection) -> None:
    """Process entry point of rank ``rank`` >= 1: commands arrive on ``commands`` (a pipe to rank 0, which also
    carries one ``ready`` back once the shard is loaded). Exits 0 when
    rank 0 says stop or closes the pipe; 1 on any error (rank 0's collectives then fail on the closed connection,
    and its watchdog sees this process end)."""
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    _exit_with_parent(spec.parent_pid)
    try:
        _serve(spec, rank, commands)
    except BaseException:
        logger.exception("tensor-parallel worker %d failed", rank)
        os._exit(1)  # skip interpreter teardown: a collective thread could otherwise hold the exit
    os._exit(0)


def _serve(spec: WorkerSpec, rank: int, commands: Connection) -> None:
    # Imported here: the spawned process pays for torch only once it runs.
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from pagoda.distributed.parallel import init_tensor_parallel
    from pagoda.distributed.shm_comm import ShmCommunicator
    from pagoda.worker.worker import COLLECTIVE_METHODS, Worker, device_for_rank

    # tqdm's default lock is a multiprocessing semaphore, which a worker ended by os._exit would leak.
    tqdm.set_lock(threading.RLock())
    if spec.worker.device_type == "cpu":
        torch.set_num_threads(spec.num_threads)
    device = device_for_rank(spec.worker.device_type, rank)
    shm = None
    if spec.shm_path is not None:
        shm = ShmCommunicator(spec.shm_path, rank, spec.world_size, spec.timeout_s, spec.shm_slot_bytes)
    commands.send_bytes(b"joining")  # rank 0 joins the rendezvous once every worker is this far
    tp = init_tensor_parallel(rank, spec.world_size, spec.init_method, device, spec.timeout_s, shm)
    worker = Worker(spec.worker, device, tp)
    logger.info("rank %d loaded its shard", rank)
    commands.send_bytes(b"ready")  # rank 0 waits for every worker before its first collective
    while True:
        try:
            command = pickle.loads(commands.recv_bytes())  # blocks while the server idles: no timeout here
        except EOFError:  # rank 0 closed the pipe without a stop (it is exiting)
            break
        if command is None:
            break
        method, args = command
        assert method in COLLECTIVE_METHODS, method
        getattr(worker, method)(*args)
    dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """Exit when the engine process is gone (even SIGKILLed, and even before this process got going: no
    collective could then ever end)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
