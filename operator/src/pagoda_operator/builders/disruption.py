"""The PodDisruptionBudget that keeps voluntary evictions (node drains, cluster upgrades) to one pod at a time.

Only for a resource that never runs on fewer than two replicas (``replicas``, or ``minReplicas`` while autoscaled).
With one replica a budget cannot help and can hurt: ``maxUnavailable: 1`` lets the only pod go anyway, and while
that pod is not Ready (loading its model, or crash-looping) the eviction API refuses to evict it (its
``desiredHealthy`` is 0, which the default unhealthy-pod policy never lets through), so a node drain would stall
for as long as that lasts. ``unhealthyPodEvictionPolicy: AlwaysAllow`` would lift that, but Kubernetes before 1.26
does not know the field and refuses the whole object.
"""

from __future__ import annotations

from typing import Any, Optional

from pagoda_operator.builders.meta import Owner, child_metadata, selector_labels
from pagoda_operator.spec import ModelDeploymentSpec

PDB_API_VERSION = "policy/v1"
PDB_PLURAL = "poddisruptionbudgets"


def build_pdb(spec: ModelDeploymentSpec, owner: Owner) -> Optional[dict[str, Any]]:
    """A policy/v1 PodDisruptionBudget over the engine pods (the Deployment's selector), or None when unwanted."""
    if spec.min_replicas < 2:
        return None
    return {
        "apiVersion": PDB_API_VERSION,
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner),
        # maxUnavailable, not minAvailable: it follows the replica count as the autoscaler changes it.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner)}},
    }
