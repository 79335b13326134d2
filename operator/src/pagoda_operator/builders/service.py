"""The Service in front of the engine pods."""

from __future__ import annotations

from typing import Any

from pagoda_operator.builders.meta import Owner, child_metadata, selector_labels
from pagoda_operator.spec import ModelDeploymentSpec


def build_service(spec: ModelDeploymentSpec, owner: Owner) -> dict[str, Any]:
    """A Service whose port (named http) forwards to the engine's port 8000; only ready pods get traffic."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner),
        "spec": {
            "type": spec.service_type,
            "selector": selector_labels(owner),
            "ports": [{"name": "http", "port": spec.service_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def endpoint_url(spec: ModelDeploymentSpec, owner: Owner) -> str:
    """The in-cluster base URL of the OpenAI-compatible API."""
    return f"http://{owner.name}.{owner.namespace}.svc.cluster.local:{spec.service_port}/v1"
