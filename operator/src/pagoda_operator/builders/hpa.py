"""The HorizontalPodAutoscaler used in autoscaling mode ``hpa``."""

from __future__ import annotations

from typing import Any, Optional

from pagoda_operator.builders.meta import Owner, child_metadata
from pagoda_operator.constants import WAITING_METRIC
from pagoda_operator.spec import ModelDeploymentSpec


def _quantity(value: float) -> str:
    # Quantities are strings; milli-units keep fractional targets such as 0.5 exact.
    return str(int(value)) if value == int(value) else f"{round(value * 1000)}m"


def build_hpa(spec: ModelDeploymentSpec, owner: Owner) -> Optional[dict[str, Any]]:
    """An autoscaling/v2 HPA on the per-pod average of waiting requests, or None when it is not wanted."""
    scaling = spec.autoscaling
    if not (scaling.enabled and scaling.mode == "hpa"):
        return None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(owner),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": WAITING_METRIC},
                        "target": {"type": "AverageValue", "averageValue": _quantity(scaling.target_waiting_requests)},
                    },
                }
            ],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": scaling.scale_up_stabilization_seconds},
                "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds},
            },
        },
    }
