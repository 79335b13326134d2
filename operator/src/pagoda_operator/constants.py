"""Names shared by the CRD, the builders and the handlers."""

import os

GROUP = "pagoda.dev"
VERSION = "v1alpha1"
PLURAL = "modeldeployments"
KIND = "ModelDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

FIELD_MANAGER = "pagoda-operator"
# Owns Deployment.spec.replicas while autoscaling is on (the built-in autoscaler writes with it; with an HPA the
# controller's own writes join it), so the operator's applies, which then leave replicas out, never reset it.
AUTOSCALER_FIELD_MANAGER = "pagoda-autoscaler"
ENGINE_PORT = 8000
# The default engine image; the chart sets PAGODA_ENGINE_IMAGE from `engineImage` in its values.
DEFAULT_ENGINE_IMAGE = os.environ.get("PAGODA_ENGINE_IMAGE", "ghcr.io/pagoda-dev/pagoda-engine:0.1.0")
WAITING_METRIC = "vllm:num_requests_waiting"
# Seconds preStop sleeps so endpoints controllers and load balancers stop sending traffic before the drain starts.
PRESTOP_SLEEP_SECONDS = 5

# Scale from zero: the router writes ``status.demandAt`` of a ModelDeployment (RFC 3339 UTC, e.g.
# 2026-12-03T14:00:00Z) through the status subresource while it holds requests for a model with no ready pod, so its
# RBAC needs only ``modeldeployments/status`` (the API server ignores spec and metadata in a status patch). The
# built-in autoscaler reads it, or this annotation (for people: kubectl annotate), as demand for one replica. The
# router never writes replicas: the operator stays their only writer in builtin mode.
DEMAND_STATUS_FIELD = "demandAt"
DEMAND_ANNOTATION = f"{GROUP}/demand-at"
# Seconds a demand stamp counts for; the router re-stamps at most every DEMAND_STAMP_INTERVAL_SECONDS while it holds.
DEMAND_TTL_SECONDS = 120
DEMAND_STAMP_INTERVAL_SECONDS = 10
# KV cache events (spec.routing.kvEvents): the engine's ZMQ publisher and replay ports, by container port name.
KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = 5558
KV_EVENTS_PORT_NAME = "kv-events"
KV_EVENTS_REPLAY_PORT_NAME = "kv-replay"
KV_EVENTS_TOPIC = "kv-events"
# The router's own gauge of requests it holds for a model at zero ready pods (a KEDA trigger reads it too).
ROUTER_HELD_METRIC = "pagoda_router_held_requests"
