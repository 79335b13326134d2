"""``spec.routing``: the InferencePool and InferenceObjective of the Gateway API Inference Extension (GAIE), the
pod labels its endpoint picker and llm-d's read, and the engine's KV cache events.

The InferencePool (``inference.networking.k8s.io/v1``) selects this model's pods by the Deployment's own selector
labels and targets the engine's HTTP port; its ``endpointPickerRef`` names the endpoint picker (EPP) a Gateway asks
which pod serves each request. The EPP scrapes the pods' ``/metrics`` with vLLM's names, which the engine exports
(``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:lora_requests_info``, ``vllm:cache_config_info``); the engine-type labels below tell a mixed-engine EPP to
read them as vLLM's. An InferenceObjective (``inference.networking.x-k8s.io/v1alpha2``, same name as the model)
gives the pool's requests that name a priority; requests select it by name (GAIE's objective header).

With ``kvEvents`` the engine publishes its KV cache block events over ZMQ (vLLM's wire format) on the container
ports named ``kv-events`` and ``kv-replay``, where routers (Pagoda's own, llm-d's KV cache indexer) subscribe.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pagoda_operator.builders.meta import Owner, child_metadata, selector_labels
from pagoda_operator.constants import (
    ENGINE_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_PORT_NAME,
    KV_EVENTS_REPLAY_PORT,
    KV_EVENTS_REPLAY_PORT_NAME,
    KV_EVENTS_TOPIC,
)
from pagoda_operator.spec import ModelDeploymentSpec

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_OBJECTIVE_API_VERSION = "inference.networking.x-k8s.io/v1alpha2"
# Pod labels for endpoint pickers: GAIE's metrics extractor picks its metric names per pod by the engine-type label
# (vllm is also its default; llm-d renamed the key, reading the GAIE one as a fallback); llm-d's P/D filters keep
# pods whose role is "both" (prefill and decode) for either phase.
ROUTING_POD_LABELS = {
    "inference.networking.k8s.io/engine-type": "vllm",
    "llm-d.ai/engine-type": "vllm",
    "llm-d.ai/inferenceServing": "true",
    "llm-d.ai/role": "both",
}
# The engine's --kv-events-config (vLLM's KVEventsConfig): publish on every interface, replay on the next port.
KV_EVENTS_CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
    "replay_endpoint": f"tcp://*:{KV_EVENTS_REPLAY_PORT}",
    "topic": KV_EVENTS_TOPIC,
}


def routing_pod_labels(spec: ModelDeploymentSpec) -> dict[str, str]:
    """Labels added to the pod template (never to the Deployment's selector, which is immutable) when the model is
    in an InferencePool; none otherwise, so turning routing on or off is the only thing that changes them."""
    return dict(ROUTING_POD_LABELS) if spec.routing.inference_pool else {}


def kv_events_args(spec: ModelDeploymentSpec) -> list[str]:
    """``--kv-events-config JSON`` with ``spec.routing.kvEvents``, else nothing."""
    if not spec.routing.kv_events:
        return []
    return ["--kv-events-config", json.dumps(KV_EVENTS_CONFIG, separators=(",", ":"))]


def kv_events_ports(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """The container ports a router finds the KV events publisher by (``tcp://{podIP}:{port}``)."""
    if not spec.routing.kv_events:
        return []
    return [
        {"name": KV_EVENTS_PORT_NAME, "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
        {"name": KV_EVENTS_REPLAY_PORT_NAME, "containerPort": KV_EVENTS_REPLAY_PORT, "protocol": "TCP"},
    ]


def build_inference_pool(spec: ModelDeploymentSpec, owner: Owner) -> Optional[dict[str, Any]]:
    """The InferencePool over this model's pods, or None without ``spec.routing.inferencePool.enabled``."""
    picker = spec.routing.endpoint_picker
    if picker is None:
        return None
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": child_metadata(owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "name": picker.name,
                "kind": picker.kind,
                "group": picker.group,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }


def build_inference_objective(spec: ModelDeploymentSpec, owner: Owner) -> Optional[dict[str, Any]]:
    """The InferenceObjective on this model's pool, or None without ``spec.routing.objective``."""
    if spec.routing.objective_priority is None or not spec.routing.inference_pool:
        return None
    return {
        "apiVersion": INFERENCE_OBJECTIVE_API_VERSION,
        "kind": "InferenceObjective",
        "metadata": child_metadata(owner),
        "spec": {
            "priority": spec.routing.objective_priority,
            "poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": owner.name},
        },
    }
