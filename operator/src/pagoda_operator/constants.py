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
