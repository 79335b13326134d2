"""The KEDA ScaledObject of autoscaling mode ``keda``: scale to and from zero on Prometheus queries.

KEDA's own HPA scales the Deployment between one replica and ``maxReplicas``; KEDA itself takes it from 0 to 1 when a
trigger becomes active (its value above its ``activationThreshold``) and back to 0 (``minReplicas: 0``) once every
trigger has been inactive for ``cooldownPeriod`` seconds. Every query is this model's own, never a namespace's sum:
the engine series by the labels the chart's ServiceMonitor gives them (``namespace``, ``service``: the engine
Service, named after the ModelDeployment) and the engine's ``model_name`` (spec's servedModelName); the router's by
its ``model_namespace`` and ``model_deployment`` labels. The triggers:

- ``waiting-requests``: ``vllm:num_requests_waiting``, target ``targetWaitingRequests`` per replica (what mode
  ``hpa`` scales on), active above ``keda.activationWaitingRequests``;
- ``running-requests``: ``vllm:num_requests_running``, target the engine's batch size (``maxNumSeqs``): it never asks
  for more replicas than serve the running batch already, but stays active while any request runs, so a busy model
  whose queue is empty is not taken to zero under its clients;
- ``router-held-requests``: the router's gauge of requests it holds for a model with no ready pod, active above 0:
  what wakes a model at zero (it has no engine series then).
"""

from __future__ import annotations

from typing import Any, Optional

from pagoda_operator.builders.meta import Owner, child_metadata
from pagoda_operator.constants import ROUTER_HELD_METRIC, WAITING_METRIC
from pagoda_operator.spec import ModelDeploymentSpec

SCALED_OBJECT_API_VERSION = "keda.sh/v1alpha1"
RUNNING_METRIC = "vllm:num_requests_running"
ENGINE_DEFAULT_MAX_NUM_SEQS = 256  # pagoda serve's --max-num-seqs default


def _number(value: float) -> str:
    # KEDA reads thresholds from strings; integral values without a trailing .0
    return str(int(value)) if value == int(value) else repr(float(value))


def _label(value: str) -> str:
    # a PromQL string literal (double-quoted; backslash and quote escaped)
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def engine_query(metric: str, spec: ModelDeploymentSpec, owner: Owner) -> str:
    """The sum of ``metric`` over this model's engine pods (the ServiceMonitor's labels, the engine's model_name)."""
    labels = f"namespace={_label(owner.namespace)},service={_label(owner.name)}"
    return f"sum({metric}{{{labels},model_name={_label(spec.served_model_name)}}})"


def held_query(owner: Owner) -> str:
    """The requests the router replicas hold for this model."""
    labels = f"model_namespace={_label(owner.namespace)},model_deployment={_label(owner.name)}"
    return f"sum({ROUTER_HELD_METRIC}{{{labels}}})"


def _trigger(name: str, address: str, query: str, threshold: float, activation: float) -> dict[str, Any]:
    metadata = {
        "serverAddress": address,
        "query": query,
        "threshold": _number(threshold),
        "activationThreshold": _number(activation),
    }
    return {"type": "prometheus", "name": name, "metadata": metadata}


def build_scaled_object(spec: ModelDeploymentSpec, owner: Owner) -> Optional[dict[str, Any]]:
    """The ScaledObject for autoscaling mode ``keda``, or None in any other mode."""
    scaling = spec.autoscaling
    if not (scaling.enabled and scaling.mode == "keda"):
        return None
    keda = scaling.keda
    address = keda.server_address or ""  # parse_spec refuses keda mode without one
    target = scaling.target_waiting_requests
    batch = spec.max_num_seqs or ENGINE_DEFAULT_MAX_NUM_SEQS
    triggers = [
        _trigger(
            "waiting-requests",
            address,
            engine_query(WAITING_METRIC, spec, owner),
            target,
            keda.activation_waiting_requests,
        ),
        _trigger("running-requests", address, engine_query(RUNNING_METRIC, spec, owner), batch, 0),
        _trigger("router-held-requests", address, held_query(owner), target, 0),
    ]
    behavior = {
        "scaleUp": {"stabilizationWindowSeconds": scaling.scale_up_stabilization_seconds},
        "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds},
    }
    return {
        "apiVersion": SCALED_OBJECT_API_VERSION,
        "kind": "ScaledObject",
        "metadata": child_metadata(owner),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": keda.polling_interval,
            "cooldownPeriod": keda.cooldown_period,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior}},
            "triggers": triggers,
        },
    }
