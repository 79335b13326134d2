"""``spec.routing`` (an InferencePool for a Gateway API Inference Extension endpoint picker, an InferenceObjective,
KV cache events) and ``spec.autoscaling.keda`` (a KEDA ScaledObject), parsed into frozen settings.

Mirrors the CRD's CEL rules on these fields as ``InvalidSpec``, so a body that never passed an API server is refused
the same way. The Prometheus address KEDA queries is ``spec.autoscaling.keda.serverAddress``, else the operator's
``PAGODA_PROMETHEUS_URL``; a keda-mode spec with neither is invalid (the CRD cannot see the operator's environment,
so that one rule is the operator's alone).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from pagoda_operator.spec_errors import InvalidSpec

PROMETHEUS_URL_ENV = "PAGODA_PROMETHEUS_URL"
FAILURE_MODES = ("FailOpen", "FailClose")
DEFAULT_EPP_PORT = 9002  # the endpoint picker's ext-proc port, GAIE's own default
AUTOSCALING_MODES = ("builtin", "hpa", "keda")
SCALE_TO_ZERO_MODES = ("builtin", "keda")  # an HPA's minReplicas 0 needs the HPAScaleToZero alpha gate


@dataclass(slots=True, frozen=True)
class EndpointPickerRef:
    """Where the InferencePool's endpoint picker (an ext-proc service) is: ``spec.routing.inferencePool``."""

    name: str
    port: int = DEFAULT_EPP_PORT
    kind: str = "Service"
    group: str = ""
    failure_mode: str = "FailClose"


@dataclass(slots=True, frozen=True)
class Routing:
    """``spec.routing``: an InferencePool over this model's pods when ``endpoint_picker`` is set (the pool is
    enabled), an InferenceObjective of ``objective_priority`` on it, and KV cache events from the engine pods."""

    endpoint_picker: Optional[EndpointPickerRef] = None
    objective_priority: Optional[int] = None
    kv_events: bool = False

    @property
    def inference_pool(self) -> bool:
        """Whether an InferencePool is wanted."""
        return self.endpoint_picker is not None


@dataclass(slots=True, frozen=True)
class KedaSettings:
    """``spec.autoscaling.keda``: what the ScaledObject's Prometheus triggers need (``server_address`` resolved:
    the field, else ``PAGODA_PROMETHEUS_URL``; None only outside keda mode)."""

    server_address: Optional[str] = None
    # KEDA activates a trigger when its value is above this; 0: any waiting request wakes the model
    activation_waiting_requests: float = 0.0
    polling_interval: int = 15
    cooldown_period: int = 300


def _picker(raw: Mapping[str, Any]) -> EndpointPickerRef:
    ref = raw.get("endpointPickerRef")
    if not ref or not ref.get("name"):
        raise InvalidSpec("spec.routing.inferencePool.endpointPickerRef", "required when inferencePool is enabled")
    picker = EndpointPickerRef(
        name=str(ref["name"]),
        port=int(ref.get("port", DEFAULT_EPP_PORT)),
        kind=str(ref.get("kind", "Service")),
        group=str(ref.get("group", "")),
        failure_mode=str(ref.get("failureMode", "FailClose")),
    )
    if picker.failure_mode not in FAILURE_MODES:
        raise InvalidSpec("spec.routing.inferencePool.endpointPickerRef.failureMode", f"one of {FAILURE_MODES}")
    return picker


def parse_routing(raw: Optional[Mapping[str, Any]], prefix_caching: Optional[bool] = None) -> Routing:
    """``spec.routing`` (absent: no routing children, no KV events); ``prefix_caching``: spec.enablePrefixCaching."""
    raw = raw or {}
    pool = raw.get("inferencePool") or {}
    picker = _picker(pool) if pool.get("enabled", False) else None
    objective = raw.get("objective")
    if objective is not None and picker is None:
        raise InvalidSpec("spec.routing.objective", "needs routing.inferencePool.enabled (its poolRef is the pool)")
    priority = None if objective is None else int(objective.get("priority", 0))
    kv_events = bool(raw.get("kvEvents", False))
    if kv_events and prefix_caching is False:  # the events describe the prefix cache's blocks: the engine refuses it
        raise InvalidSpec("spec.routing.kvEvents", "needs prefix caching: drop enablePrefixCaching: false")
    return Routing(endpoint_picker=picker, objective_priority=priority, kv_events=kv_events)


def parse_keda(raw: Mapping[str, Any], mode: str, enabled: bool) -> KedaSettings:
    """``spec.autoscaling.keda`` of ``raw`` (``spec.autoscaling``), checked against the autoscaling mode."""
    keda = raw.get("keda")
    if keda is not None and mode != "keda":
        raise InvalidSpec("spec.autoscaling.keda", "applies to autoscaling mode keda only")
    keda = keda or {}
    address = keda.get("serverAddress") or os.environ.get(PROMETHEUS_URL_ENV) or None
    if enabled and mode == "keda" and not address:
        raise InvalidSpec(
            "spec.autoscaling.keda.serverAddress", f"required in mode keda (the operator has no {PROMETHEUS_URL_ENV})"
        )
    settings = KedaSettings(
        server_address=address,
        activation_waiting_requests=float(keda.get("activationWaitingRequests", 0)),
        polling_interval=int(keda.get("pollingInterval", 15)),
        cooldown_period=int(keda.get("cooldownPeriod", 300)),
    )
    if settings.activation_waiting_requests < 0:
        raise InvalidSpec("spec.autoscaling.keda.activationWaitingRequests", "must not be negative")
    return settings


def check_scaling_mode(mode: str, enabled: bool, min_replicas: int) -> None:
    """The mode is known, and minReplicas 0 only where something can wake the model (the CRD's CEL rule)."""
    if mode not in AUTOSCALING_MODES:
        raise InvalidSpec("spec.autoscaling.mode", f"{mode!r} is not one of {', '.join(AUTOSCALING_MODES)}")
    if min_replicas < 0:
        raise InvalidSpec("spec.autoscaling.minReplicas", "must not be negative")
    if enabled and min_replicas == 0 and mode not in SCALE_TO_ZERO_MODES:
        raise InvalidSpec(
            "spec.autoscaling.minReplicas",
            f"0 needs mode builtin or keda: a HorizontalPodAutoscaler (mode {mode}) cannot scale to zero",
        )
