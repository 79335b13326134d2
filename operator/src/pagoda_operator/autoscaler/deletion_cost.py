"""Scale-down prefers idle pods: each Ready pod's running requests become its ``pod-deletion-cost``.

When a Deployment's replicas drop, the ReplicaSet controller deletes the pods with the lowest
``controller.kubernetes.io/pod-deletion-cost`` first (among pods equal in phase and readiness). The autoscaler sets
it from the same scrape its decision came from, just before it lowers the replicas, so the pods it stops are the ones
with the least work in flight (which then drains for the least time). Only on a scale-down, and only where the value
changed: a steady model's pods are not patched every tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda_operator.autoscaler.algorithm import PodSample
from pagoda_operator.kube import KubeClient, KubeError, object_path
from pagoda_operator.pods import is_ready

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_MAX_COST = 2**31 - 1  # the annotation is an int32


def deletion_costs(pods: Sequence[Mapping[str, Any]], samples: Sequence[PodSample]) -> dict[str, str]:
    """Pod name -> the cost to write: its running requests, for Ready pods whose count is known and whose annotation
    says something else. Pods without a count keep what they have (unknown is not zero: never marked idle)."""
    running = {s.name: s.metrics.running for s in samples if s.ready and s.metrics and s.metrics.running is not None}
    costs: dict[str, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = meta.get("name")
        if name not in running or not is_ready(pod):
            continue
        cost = str(min(_MAX_COST, max(0, round(running[name]))))
        if (meta.get("annotations") or {}).get(DELETION_COST) != cost:
            costs[name] = cost
    return costs


async def write_deletion_costs(kube: KubeClient, namespace: str, costs: Mapping[str, str]) -> None:
    """Merge-patch each pod's annotation, all at once; a pod deleted meanwhile needs none. Any other failure
    propagates, so the caller does not scale down on costs that were not written."""

    async def one(name: str, cost: str) -> None:
        patch = {"metadata": {"annotations": {DELETION_COST: cost}}}
        try:
            await kube.merge_patch(object_path("v1", "pods", namespace, name), patch)
        except KubeError as error:
            if error.status != 404:
                raise

    await asyncio.gather(*(one(name, cost) for name, cost in costs.items()))
