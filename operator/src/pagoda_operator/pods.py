"""What the operator reads of an engine pod to reach it over HTTP (the autoscaler's scrape, the adapter status)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda_operator.constants import ENGINE_PORT


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready, with an IP, and not being deleted: a pod that serves traffic."""
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and bool(status.get("podIP")) and not (pod.get("metadata") or {}).get("deletionTimestamp")


def http_port(pod: Mapping[str, Any]) -> int:
    """The engine container's port named http, as the builders declare it; the constant for pods without one."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return ENGINE_PORT


def pod_url(pod: Mapping[str, Any], path: str) -> str:
    """``http://{podIP}:{http port}{path}``."""
    return f"http://{pod['status']['podIP']}:{http_port(pod)}{path}"
