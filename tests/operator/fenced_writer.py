"""``python fenced_writer.py NAMESPACE LEASE IDENTITY``: a replica that wins the Lease, then writes without pause,
as a busy operator would, through a ``KubeClient`` fenced by its elector.

It creates a ConfigMap ``IDENTITY-N`` (label ``writer=IDENTITY``) every 0.1 s, whether or not it still leads: only
the fence decides what reaches the API server. It prints ``leading`` once it holds the Lease and ``fenced`` for each
write refused; when ``keep`` returns it tries writing for one more second, then exits 1 (the Lease was lost).
Credentials: ``$KUBECONFIG``. The lease is 3 s, renewed every 0.5 s (renew deadline 2 s).
"""

from __future__ import annotations

import asyncio
import sys

import kopf

from pagoda_operator.kube import KubeClient, object_path
from pagoda_operator.leader import LeadershipLost, LeaseElector

LEASE_SECONDS = 3
RETRY_SECONDS = 0.5


async def write_until_lost(namespace: str, lease: str, identity: str) -> int:
    """Lead, write every 0.1 s until a second after ``keep`` returned; the exit status (1: the Lease was lost)."""
    settings = kopf.OperatorSettings()
    elector = LeaseElector(
        KubeClient.from_environment(settings), namespace, lease, identity, LEASE_SECONDS, RETRY_SECONDS
    )
    writes = KubeClient.from_environment(settings, fence=elector.fence)
    await elector.acquire()
    print("leading", flush=True)
    keeper = asyncio.create_task(elector.keep())
    stop_at, seq = float("inf"), 0
    loop = asyncio.get_running_loop()
    while loop.time() < stop_at:
        if keeper.done() and stop_at == float("inf"):
            stop_at = loop.time() + 1.0
        meta = {"name": f"{identity}-{seq}", "namespace": namespace, "labels": {"writer": identity}}
        try:
            await writes.create(
                object_path("v1", "configmaps", namespace), {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}
            )
            seq += 1
        except LeadershipLost:
            print("fenced", flush=True)
        await asyncio.sleep(0.1)
    await writes.close()
    await elector.kube.close()
    return 1


if __name__ == "__main__":
    sys.exit(asyncio.run(write_until_lost(*sys.argv[1:4])))
