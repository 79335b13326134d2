"""spec.routing and autoscaling mode keda against a real kube-apiserver (v1.24) and the running operator.

First without the third-party CRDs: the operator reconciles everything else, shows RoutingAvailable and KedaAvailable
False and posts one Warning each, and deletes such a resource cleanly. Then with the vendored CRDs installed
(``thirdparty_crds/``: GAIE's InferencePool v1 and InferenceObjective v1alpha2, KEDA's ScaledObject): the same
resource gets its InferencePool, InferenceObjective and ScaledObject, which the API server validated against those
schemas (a deliberately broken copy of each is refused, so the schemas really are enforced), and KEDA, not the
operator, owns the Deployment's replicas. The CRDs are removed again after the module.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
from control_plane import CLUSTER_SCRIPT, Cluster, wait_for

from pagoda_operator.constants import FIELD_MANAGER
from pagoda_operator.reconcile import owns_replicas

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")]

NS = "pagoda-routing"
PROMETHEUS = "http://prometheus.test:9090"
OPERATOR_ENV = {"PAGODA_PROMETHEUS_URL": PROMETHEUS}  # keda mode's serverAddress when a spec names none
INTERVAL = 2.0  # the operator fixture's PAGODA_RECONCILE_INTERVAL
THIRD_PARTY = Path(__file__).parent / "thirdparty_crds"
CRDS = {
    "inferencepools.inference.networking.k8s.io": "inference.networking.k8s.io_inferencepools.yaml",
    "inferenceobjectives.inference.networking.x-k8s.io": "inference.networking.x-k8s.io_inferenceobjectives.yaml",
    "scaledobjects.keda.sh": "keda.sh_scaledobjects.yaml",
}
PATHS = {
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    "InferenceObjective": "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives",
    "ScaledObject": "/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects",
}
ROUTING = {"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "epp"}}, "objective": {"priority": 7}}
KEDA = {"enabled": True, "mode": "keda", "minReplicas": 0, "maxReplicas": 3}


def raw_get(cluster: Cluster, kind: str, name: str) -> Optional[dict[str, Any]]:
    """The object by its REST path (no kubectl discovery, which may predate the CRDs); None when missing."""
    result = cluster.kubectl("get", "--raw", f"{PATHS[kind].format(ns=NS)}/{name}", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def dry_run_create(cluster: Cluster, kind: str, obj: dict[str, Any]) -> tuple[int, str]:
    """A server-side dry-run create of ``obj``: (exit code, the API server's answer)."""
    path = f"{PATHS[kind].format(ns=NS)}?dryRun=All"
    result = cluster.kubectl("create", "--raw", path, "-f", "-", stdin=json.dumps(obj), check=False)
    return result.returncode, result.stdout + result.stderr


def fresh(obj: dict[str, Any], name: str) -> dict[str, Any]:
    """``obj`` (a live child) as a new object named ``name``: metadata the server sets removed."""
    return {**obj, "metadata": {"name": name, "namespace": NS}, "status": None}


def md_status(cluster: Cluster, name: str, kind: str) -> tuple[Any, Any]:
    condition = cluster.md_condition(name, kind)
    return condition.get("status"), condition.get("reason")


@pytest.fixture(scope="module")
def thirdparty_crds(cluster: Cluster, operator: Path) -> Iterator[None]:
    """The vendored CRDs installed (established) for the tests that ask for them; deleted after the module."""
    for name, file in CRDS.items():
        cluster.kubectl("apply", "-f", str(THIRD_PARTY / file))
        cluster.kubectl("wait", "--for", "condition=established", f"crd/{name}", "--timeout=60s")
    yield
    for name in CRDS:
        cluster.kubectl("delete", "crd", name, "--timeout=60s", check=False)


def test_without_the_crds_the_rest_is_reconciled_with_one_warning_each(cluster: Cluster, operator: Path) -> None:
    for name in CRDS:
        assert cluster.get("crd", name, "") is None, f"{name} is installed: this test needs a cluster without it"
    cluster.apply_md("early", routing=ROUTING, autoscaling=KEDA)
    cluster.apply_md("doomed", routing=ROUTING)
    deployment = wait_for("the Deployment", lambda: cluster.get("deployment", "early", NS))
    assert wait_for("the Service", lambda: cluster.get("service", "early", NS))
    assert deployment["spec"]["replicas"] == 0  # created at minReplicas 0
    assert deployment["spec"]["template"]["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"
    routing = wait_for("RoutingAvailable", lambda: cluster.md_condition("early", "RoutingAvailable"))
    assert (routing["status"], routing["reason"]) == ("False", "RoutingUnavailable")
    assert "InferencePool, InferenceObjective" in routing["message"]
    assert wait_for("KedaAvailable", lambda: md_status(cluster, "early", "KedaAvailable")) == (
        "False",
        "KedaUnavailable",
    )
    assert md_status(cluster, "doomed", "KedaAvailable") == (None, None)  # not wanted there: no condition
    time.sleep(3 * INTERVAL)  # periodic reconciles meet the same missing kinds: no more Events
    for reason in ("RoutingUnavailable", "KedaUnavailable"):
        (event,) = cluster.events("early", reason)
        assert (
            event["type"] == "Warning"
            and event["message"]
            == cluster.md_condition("early", "RoutingAvailable" if reason == "RoutingUnavailable" else "KedaAvailable")[
                "message"
            ]
        )
    assert md_status(cluster, "early", "Degraded") == ("False", "AsExpected")

    # Deleting one: the finalizer's deletes of the unknown kinds are no errors.
    cluster.kubectl("delete", "modeldeployment", "doomed", "-n", NS, "--timeout=60s")
    assert cluster.get("modeldeployment", "doomed", NS) is None


def test_once_the_crds_are_installed_the_children_appear_and_the_schemas_hold(
    cluster: Cluster, operator: Path, thirdparty_crds: None
) -> None:
    pool = wait_for("the InferencePool", lambda: raw_get(cluster, "InferencePool", "early"), 30)
    objective = wait_for("the InferenceObjective", lambda: raw_get(cluster, "InferenceObjective", "early"))
    scaled = wait_for("the ScaledObject", lambda: raw_get(cluster, "ScaledObject", "early"))
    selector = cluster.get("deployment", "early", NS)["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["selector"] == {"matchLabels": selector}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "epp",
        "kind": "Service",
        "group": "",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert pool["spec"]["appProtocol"] == "http"  # the CRD's default: the API server ran its schema
    assert objective["spec"]["poolRef"]["name"] == "early" and objective["spec"]["priority"] == 7
    assert scaled["spec"]["minReplicaCount"] == 0 and scaled["spec"]["maxReplicaCount"] == 3
    assert {t["metadata"]["serverAddress"] for t in scaled["spec"]["triggers"]} == {PROMETHEUS}  # the operator's
    for kind in ("RoutingAvailable", "KedaAvailable"):
        assert wait_for(kind, lambda k=kind: md_status(cluster, "early", k) == ("True", "Applied"))

    # The schemas are enforced: a broken copy of each is refused (a CEL rule of the InferencePool's included).
    broken_pool = fresh(pool, "broken")
    broken_pool["spec"] = {**pool["spec"], "targetPorts": [{"number": 0}]}
    no_port = fresh(pool, "no-port")
    no_port["spec"] = {**pool["spec"], "endpointPickerRef": {"name": "epp", "kind": "Service"}}
    broken_objective = fresh(objective, "broken")
    broken_objective["spec"] = {**objective["spec"], "priority": "high"}
    broken_scaled = fresh(scaled, "broken")
    broken_scaled["spec"] = {k: v for k, v in scaled["spec"].items() if k != "scaleTargetRef"}
    cases = [
        ("InferencePool", broken_pool, "targetPorts"),
        ("InferencePool", no_port, "port is required"),
        ("InferenceObjective", broken_objective, "priority"),
        ("ScaledObject", broken_scaled, "scaleTargetRef"),
    ]
    for kind, obj, field in cases:
        code, answer = dry_run_create(cluster, kind, obj)
        assert code != 0 and "is invalid" in answer and field in answer, answer
    assert dry_run_create(cluster, "InferencePool", fresh(pool, "intact"))[0] == 0  # the intact copy passes


def test_keda_owns_the_replicas_not_the_operator(cluster: Cluster, operator: Path, thirdparty_crds: None) -> None:
    assert not owns_replicas(cluster.get("deployment", "early", NS), FIELD_MANAGER)
    cluster.kubectl("scale", "deployment", "early", "-n", NS, "--replicas=2")  # as KEDA's HPA would
    time.sleep(2 * INTERVAL)
    assert cluster.get("deployment", "early", NS)["spec"]["replicas"] == 2


def test_the_api_server_refuses_min_replicas_zero_in_hpa_mode(cluster: Cluster, operator: Path) -> None:
    body = {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "hpa-zero", "namespace": NS},
        "spec": {"autoscaling": {"enabled": True, "mode": "hpa", "minReplicas": 0, "maxReplicas": 2}},
    }
    result = cluster.kubectl("apply", "-f", "-", stdin=json.dumps(body), check=False)
    assert result.returncode != 0 and "cannot scale to zero" in result.stderr, result.stderr
    body["spec"]["autoscaling"]["mode"] = "keda"  # the same in mode keda is fine
    assert cluster.kubectl("apply", "-f", "-", stdin=json.dumps(body), check=False).returncode == 0


def test_routing_and_keda_turned_off_delete_their_children(
    cluster: Cluster, operator: Path, thirdparty_crds: None
) -> None:
    cluster.apply_md("early", autoscaling={**KEDA, "mode": "builtin", "minReplicas": 1})
    for kind in ("InferencePool", "InferenceObjective", "ScaledObject"):
        wait_for(f"the {kind} deleted", lambda k=kind: raw_get(cluster, k, "early") is None)
    wait_for("no RoutingAvailable", lambda: not cluster.md_condition("early", "RoutingAvailable"))
    labels = cluster.get("deployment", "early", NS)["spec"]["template"]["metadata"]["labels"]
    assert "inference.networking.k8s.io/engine-type" not in labels
