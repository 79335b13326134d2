"""Every child of a ModelDeployment by kind: the one list that the reconciler applies and the benchmarks check."""

from __future__ import annotations

from typing import Any, Optional

from pagoda_operator.builders.deployment import build_deployment
from pagoda_operator.builders.disruption import build_pdb
from pagoda_operator.builders.hpa import build_hpa
from pagoda_operator.builders.keda import build_scaled_object
from pagoda_operator.builders.lora import build_lora_config_map
from pagoda_operator.builders.meta import Owner
from pagoda_operator.builders.routing import build_inference_objective, build_inference_pool
from pagoda_operator.builders.service import build_service
from pagoda_operator.spec import ModelDeploymentSpec


def build_children(
    spec: ModelDeploymentSpec, owner: Owner, *, include_replicas: bool = True
) -> dict[str, Optional[dict[str, Any]]]:
    """Kind -> the manifest of each child kind the operator manages, None for a kind this spec does not want (no
    HorizontalPodAutoscaler unless autoscaling mode is ``hpa``, no ScaledObject unless it is ``keda``, ...): such a child is deleted. In the order they are
    applied: the adapter list before the Deployment whose pods mount it. ``include_replicas``: see
    ``build_deployment``."""
    return {
        "ConfigMap": build_lora_config_map(spec, owner),
        "Deployment": build_deployment(spec, owner, include_replicas=include_replicas),
        "Service": build_service(spec, owner),
        "HorizontalPodAutoscaler": build_hpa(spec, owner),
        "PodDisruptionBudget": build_pdb(spec, owner),
        # kinds of other projects' CRDs: a cluster without them gets a Warning and a condition (reconcile)
        "InferencePool": build_inference_pool(spec, owner),
        "InferenceObjective": build_inference_objective(spec, owner),
        "ScaledObject": build_scaled_object(spec, owner),
    }
