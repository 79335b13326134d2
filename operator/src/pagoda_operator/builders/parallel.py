"""What a pod with ``gpus: N >= 2`` adds for tensor parallelism: a ``/dev/shm`` sized for N workers and the
environment of N worker processes that talk over NCCL (tensors) and gloo (the engine's control collectives) inside
one pod.

The engine starts one worker process per GPU, all in the engine container, so everything here is single-node:
every rank is reached through the pod's own loopback, and NCCL picks its fastest intra-node path itself (NVLink or
PCIe peer-to-peer, else shared memory). Nothing here may steer that choice (no ``NCCL_P2P_*``, ``NCCL_SHM_*``,
``NCCL_NVLS_*`` or ``NCCL_ALGO``): a wrong guess would turn NVLink off.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# /dev/shm per GPU worker, and the size of a pod with at most one GPU. NCCL keeps host-side state of every rank in
# /dev/shm segments (its proxy's operation pools, a few MiB per peer); when two GPUs have no peer-to-peer path
# (PCIe across CPU sockets, many cloud VMs) its SHM transport adds ~9 MiB per channel and connection (its LL, LL128
# and Simple buffers). That is a few hundred MiB per rank in the worst case; 1Gi per worker leaves room for
# PyTorch's own shared-memory tensors on top. A memory emptyDir is only a limit: pages count against the pod's
# memory when written, so an unused limit costs nothing, while a full /dev/shm fails NCCL's start-up ("failed to
# extend /dev/shm/nccl-...") or kills a worker with SIGBUS.
SHM_GIB_PER_WORKER = 1

# Set only for gpus >= 2 (one GPU runs no collectives), and never over a variable of the same name in
# spec.engine.env.
TENSOR_PARALLEL_ENV: dict[str, str] = {
    # NCCL is silent by default: WARN makes it print the cause of a failed start-up or collective (a full /dev/shm,
    # a lost peer) before it returns the error, so the log, and with it the termination message, names the cause.
    "NCCL_DEBUG": "WARN",
    # NCCL's bootstrap (and its socket fallback) stays on the pod's loopback: every rank is in this pod, so neither
    # a service-mesh sidecar nor an extra CNI interface can come between them. Peer-to-peer, NVLink and
    # shared-memory transfers use no sockets and are unaffected.
    "NCCL_SOCKET_IFNAME": "lo",
    # The same for the engine's gloo group (the ranks' agreements at start-up, e.g. on the KV blocks every rank can
    # hold; on CPU replicas also the tensors). Its rendezvous is already on 127.0.0.1.
    "GLOO_SOCKET_IFNAME": "lo",
}


def default_shm_size(gpus: int) -> str:
    """The ``/dev/shm`` limit of a pod whose spec sets no ``shmSize``: 1Gi per GPU worker, at least 1Gi."""
    return f"{max(1, gpus) * SHM_GIB_PER_WORKER}Gi"


def shm_size(explicit: str | None, gpus: int) -> str:
    """``spec.shmSize`` when set (it always wins), else :func:`default_shm_size`."""
    return explicit if explicit is not None else default_shm_size(gpus)


def tensor_parallel_env(gpus: int, user_env: Iterable[Any]) -> list[dict[str, str]]:
    """The variables of :data:`TENSOR_PARALLEL_ENV` for ``gpus >= 2``, less those ``spec.engine.env`` sets itself."""
    if gpus < 2:
        return []
    taken = {item.get("name") for item in user_env}
    return [{"name": name, "value": value} for name, value in TENSOR_PARALLEL_ENV.items() if name not in taken]
