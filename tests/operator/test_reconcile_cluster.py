"""The reconciler against a real kube-apiserver and controller-manager: field ownership and quiet reconciles.

Each child is written by server-side apply with the operator's field manager, so the API server itself decides
what a removed field, a hand edit or another manager's field means; kmock cannot emulate that. The operator
runs as a process (``kopf run``) with a 2 s reconcile interval. There is no kubelet: pod status is patched as a
kubelet would write it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from control_plane import CLUSTER_SCRIPT, Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")]

NS = "pagoda-reconcile"
INTERVAL = 2.0  # the operator's PAGODA_RECONCILE_INTERVAL in running_operator


@pytest.fixture(scope="module")
def cluster(cluster: Cluster) -> Cluster:
    """The module's namespace (``conftest.py``) with the Secret that ``apiKeySecretRef`` names."""
    cluster.kubectl("create", "secret", "generic", "api-key", "--from-literal=api-key=k", "-n", NS)
    return cluster


def deployment(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.get("deployment", name, NS) or {}


def managed_fields(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    """The Deployment's managedFields (kubectl hides them unless asked)."""
    args = ("get", "deployment", name, "-n", NS, "-o", "json", "--show-managed-fields")
    return json.loads(cluster.kubectl(*args).stdout)["metadata"]["managedFields"]


def engine(d: dict[str, Any]) -> dict[str, Any]:
    return d["spec"]["template"]["spec"]["containers"][0]


def env_names(d: dict[str, Any]) -> set[str]:
    return {e["name"] for e in engine(d).get("env") or []}


def settle(cluster: Cluster, name: str) -> dict[str, str]:
    """Wait until the children stop changing (three intervals without a new resourceVersion)."""
    kinds = ("deployment", "service")
    last = {k: (cluster.get(k, name, NS) or {}).get("metadata", {}).get("resourceVersion") for k in kinds}
    stable_since = time.monotonic()
    deadline = stable_since + 60
    while time.monotonic() < deadline:
        time.sleep(INTERVAL / 2)
        now = {k: (cluster.get(k, name, NS) or {}).get("metadata", {}).get("resourceVersion") for k in kinds}
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 3 * INTERVAL:
            return now
    raise AssertionError(f"the children of {name} kept changing")


def test_create_then_nothing_more_is_written_while_nothing_changes(cluster, operator) -> None:
    cluster.apply_md("quiet", maxModelLen=256)
    created = wait_for("the Deployment", lambda: deployment(cluster, "quiet"), 60)
    (ref,) = created["metadata"]["ownerReferences"]
    assert ref["kind"] == "ModelDeployment" and ref["controller"] is True
    assert wait_for("the Service", lambda: cluster.get("service", "quiet", NS), 30)
    versions = settle(cluster, "quiet")
    managers = {(m["manager"], m["operation"]) for m in managed_fields(cluster, "quiet")}
    assert ("pagoda-operator", "Apply") in managers and ("pagoda-operator", "Update") not in managers
    time.sleep(4 * INTERVAL)  # four periodic reconciles
    assert {k: (cluster.get(k, "quiet", NS) or {})["metadata"]["resourceVersion"] for k in versions} == versions
    assert len(cluster.events("quiet", "Created")) == 2  # Deployment and Service, once
    assert not [e["message"] for e in cluster.events("quiet", "Updated")]


def test_fields_removed_from_the_spec_are_removed_from_the_deployment(cluster, operator) -> None:
    spec = dict(
        nodeSelector={"pool": "llm"},
        apiKeySecretRef={"name": "api-key"},
        resources={"limits": {"cpu": "2", "memory": "4Gi"}},
    )
    cluster.apply_md("pruned", **spec)
    full = wait_for(
        "the node selector, API key and resources",
        lambda: (d := deployment(cluster, "pruned")) and d["spec"]["template"]["spec"].get("nodeSelector") and d,
        60,
    )
    assert "PAGODA_API_KEY" in env_names(full) and engine(full)["resources"]["limits"]["cpu"] == "2"
    cluster.apply_md("pruned")  # all three removed, as a GitOps tool re-applies the edited manifest

    def pruned() -> bool:
        d = deployment(cluster, "pruned")
        return (
            "nodeSelector" not in d["spec"]["template"]["spec"]
            and "PAGODA_API_KEY" not in env_names(d)
            and "cpu" not in (engine(d).get("resources") or {}).get("limits", {})
        )

    wait_for("the removed fields to leave the Deployment", pruned, 60)


def test_hand_edits_of_owned_fields_are_reverted_and_other_fields_left_alone(cluster, operator) -> None:
    cluster.apply_md("edited", maxModelLen=256)
    wait_for("the Deployment", lambda: deployment(cluster, "edited"), 60)
    settle(cluster, "edited")
    cluster.kubectl("set", "env", "deployment/edited", "-n", NS, "FOO=bar")  # a field the operator does not set
    patch = {"spec": {"template": {"spec": {"terminationGracePeriodSeconds": 1}}}}  # one it does
    cluster.kubectl("patch", "deployment", "edited", "-n", NS, "--type=merge", "-p", json.dumps(patch))
    wait_for(
        "the grace period to be restored",
        lambda: deployment(cluster, "edited")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 1,
        30,
    )
    versions = settle(cluster, "edited")  # no endless re-applies against the foreign field ...
    assert "FOO" in env_names(deployment(cluster, "edited"))  # ... which stays
    time.sleep(3 * INTERVAL)
    assert deployment(cluster, "edited")["metadata"]["resourceVersion"] == versions["deployment"]
    assert len(cluster.events("edited", "Updated")) == 1  # the one revert


def test_deleted_children_are_recreated_and_a_spec_change_applies(cluster, operator) -> None:
    cluster.apply_md("restored", replicas=1, maxModelLen=256)
    wait_for("the Deployment", lambda: deployment(cluster, "restored"), 60)
    cluster.kubectl("delete", "deployment", "restored", "-n", NS)
    cluster.kubectl("delete", "service", "restored", "-n", NS)
    wait_for("the Deployment again", lambda: deployment(cluster, "restored"), 30)
    wait_for("the Service again", lambda: cluster.get("service", "restored", NS), 30)
    cluster.apply_md("restored", replicas=2, maxModelLen=1024)

    def updated() -> bool:
        d = deployment(cluster, "restored")
        args = engine(d)["args"]
        return d["spec"]["replicas"] == 2 and args[args.index("--max-model-len") + 1] == "1024"

    wait_for("the spec change on the Deployment", updated, 30)
    assert cluster.events("restored", "Updated")


def test_switching_autoscaling_on_keeps_the_live_replica_count(cluster, operator) -> None:
    cluster.apply_md("scaled", replicas=3)
    wait_for("3 replicas", lambda: deployment(cluster, "scaled").get("spec", {}).get("replicas") == 3, 60)
    hpa = {"enabled": True, "mode": "hpa", "minReplicas": 1, "maxReplicas": 6}
    cluster.apply_md("scaled", replicas=3, autoscaling=hpa)
    wait_for("the HPA", lambda: cluster.get("horizontalpodautoscaler", "scaled", NS), 30)
    settle(cluster, "scaled")
    assert deployment(cluster, "scaled")["spec"]["replicas"] == 3  # not dropped to the default of 1
    # What the HPA does through the scale subresource; later reconciles leave it alone.
    cluster.kubectl("scale", "deployment", "scaled", "-n", NS, "--replicas=5")
    time.sleep(3 * INTERVAL)
    assert deployment(cluster, "scaled")["spec"]["replicas"] == 5
    cluster.apply_md("scaled", replicas=2)  # autoscaling off: spec.replicas rules again
    wait_for("spec.replicas back in charge", lambda: deployment(cluster, "scaled")["spec"]["replicas"] == 2, 30)
    wait_for("the HPA deleted", lambda: cluster.get("horizontalpodautoscaler", "scaled", NS) is None, 30)


def test_a_resource_created_autoscaled_starts_at_min_replicas(cluster, operator) -> None:
    hpa = {"enabled": True, "mode": "hpa", "minReplicas": 2, "maxReplicas": 4}
    cluster.apply_md("born-scaled", autoscaling=hpa)
    wait_for("2 replicas", lambda: deployment(cluster, "born-scaled").get("spec", {}).get("replicas") == 2, 60)
    settle(cluster, "born-scaled")
    fields = managed_fields(cluster, "born-scaled")
    owners = {m["manager"] for m in fields if "f:replicas" in m["fieldsV1"].get("f:spec", {})}
    assert owners == {"pagoda-autoscaler"} and deployment(cluster, "born-scaled")["spec"]["replicas"] == 2


def test_a_quiet_hpa_is_not_re_applied_on_every_pass(cluster, operator) -> None:
    # v1.24 returns a dry-run apply of an autoscaling/v2 HPA with its first metric duplicated (kubernetes#118293):
    # compared naively, every reconcile re-applied the HPA and posted an Updated Event (found at 200 resources).
    cluster.apply_md("quiet-hpa", autoscaling={"enabled": True, "mode": "hpa", "minReplicas": 1, "maxReplicas": 3})
    hpa = wait_for("the HPA", lambda: cluster.get("horizontalpodautoscaler", "quiet-hpa", NS), 60)
    assert len(hpa["spec"]["metrics"]) == 1
    settle(cluster, "quiet-hpa")
    version = cluster.get("horizontalpodautoscaler", "quiet-hpa", NS)["metadata"]["resourceVersion"]
    time.sleep(3 * INTERVAL)  # three periodic reconciles
    assert cluster.get("horizontalpodautoscaler", "quiet-hpa", NS)["metadata"]["resourceVersion"] == version
    assert not [e for e in cluster.events("quiet-hpa", "Updated") if "HorizontalPodAutoscaler" in e["message"]]


def test_deleting_the_resource_deletes_its_children(cluster, operator) -> None:
    cluster.apply_md("doomed", autoscaling={"enabled": True, "mode": "hpa", "maxReplicas": 3})
    wait_for("the HPA", lambda: cluster.get("horizontalpodautoscaler", "doomed", NS), 60)
    cluster.kubectl("delete", "modeldeployment", "doomed", "-n", NS, "--wait=false")

    def gone() -> bool:
        kinds = ("modeldeployment", "deployment", "service", "horizontalpodautoscaler")
        return all(cluster.get(kind, "doomed", NS) is None for kind in kinds)

    wait_for("the resource and its children to be gone", gone, 60)


def test_ready_pods_make_the_resource_ready(cluster, operator) -> None:
    cluster.apply_md("ready", replicas=2, model={"servedModelName": "tiny"})
    pods = wait_for(
        "the ReplicaSet's two pods", lambda: len(cluster.pods_of("ready")) == 2 and cluster.pods_of("ready")
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for pod in pods:  # what the kubelet writes once the engine's readiness probe passes
        containers = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": True,
                "restartCount": 0,
                "started": True,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod["spec"]["containers"]
        ]
        ready = [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("Initialized", "Ready", "ContainersReady")
        ]
        status = {"phase": "Running", "conditions": ready, "containerStatuses": containers}
        cluster.patch_pod_status(pod["metadata"]["name"], status)
    # The Deployment controller counts them; the operator's Deployment watch carries that to the resource.
    wait_for("Ready", lambda: cluster.md_condition("ready", "Ready").get("status") == "True", 60)
    status = cluster.get("modeldeployment", "ready", NS)["status"]
    assert status["readyReplicas"] == 2 and cluster.md_condition("ready", "Ready")["reason"] == "AllReplicasReady"
    assert status["endpoint"] == f"http://ready.{NS}.svc.cluster.local:8000/v1"
    assert status["servedModelName"] == "tiny"
    assert status["selector"] == "app.kubernetes.io/instance=ready,app.kubernetes.io/name=pagoda-engine"


def test_a_crash_looping_engine_is_model_load_failed(cluster, operator) -> None:
    cluster.apply_md("crashing")
    pod = wait_for("the pod", lambda: cluster.pods_of("crashing"), 60)[0]
    container = {
        "name": "engine",
        "image": "engine",
        "imageID": "",
        "ready": False,
        "restartCount": 4,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": "Traceback ... RuntimeError: boom"}},
    }
    cluster.patch_pod_status(pod["metadata"]["name"], {"containerStatuses": [container]})
    found = wait_for(
        "ModelLoadFailed",
        lambda: (c := cluster.md_condition("crashing", "Degraded")).get("status") == "True" and c,
        60,
    )
    assert found["reason"] == "ModelLoadFailed" and pod["metadata"]["name"] in found["message"]
