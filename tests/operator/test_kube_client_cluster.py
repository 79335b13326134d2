"""The API client and the operator's Deployment watch against a real kube-apiserver and controller-manager: list
pagination, server-side label selection of the watch, a relist after 410 Gone, and the running operator carrying a
Deployment's status change to its owner with no reconcile timer to do it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kopf
import pytest
import pytest_asyncio
from control_plane import CLUSTER_SCRIPT, Cluster, own_namespace, running_operator, wait_for

from pagoda_operator.child_watch import SELECTOR, ChildWatch, ChildWatches
from pagoda_operator.kube import KubeClient, KubeError, object_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster"),
]

NS = "pagoda-client"
OURS = {**SELECTOR, "pagoda.dev/model-deployment": "owner"}


@pytest_asyncio.fixture()
async def kube(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeClient]:
    monkeypatch.setenv("KUBECONFIG", cluster.kubeconfig)
    client = KubeClient.from_environment(kopf.OperatorSettings())  # kopf's kubeconfig login, as in production
    yield client
    await client.close()


def deployment(name: str, labels: dict[str, str]) -> dict[str, Any]:
    pod = {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": pod},
    }


async def eventually(what: str, check: Callable[[], Any], timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_list_reads_every_page_of_a_collection_larger_than_a_page(cluster: Cluster, kube: KubeClient) -> None:
    for i in range(5):
        meta = {"name": f"page-{i}", "namespace": NS, "labels": {"paged": "yes"}}
        await kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta})
    path = object_path("v1", "configmaps", NS)
    # No label selector here: this v1.24.1 server drops items from label-selected pages whenever it has to read
    # past non-matching keys to fill one (kubernetes#110652, fixed in 1.24.3); an unselected page is exact.
    first = json.loads(cluster.kubectl("get", "--raw", f"{path}?limit=2").stdout)
    assert len(first["items"]) == 2 and first["metadata"]["continue"]  # the server really pages
    items, version = await kube.list_with_version(path, {}, page_size=2)
    unpaged = json.loads(cluster.kubectl("get", "configmaps", "-n", NS, "-o", "json").stdout)["items"]
    names = sorted(i["metadata"]["name"] for i in items)
    assert names == sorted(i["metadata"]["name"] for i in unpaged) and len(names) > 2
    assert {f"page-{i}" for i in range(5)} <= set(names) and int(version) > 0


async def test_the_watch_sees_our_deployments_and_never_another(cluster: Cluster, kube: KubeClient) -> None:
    refreshed: list[tuple[str, str]] = []

    async def refresh(namespace: str, name: str) -> None:
        refreshed.append((namespace, name))

    events: list[dict[str, Any]] = []  # everything the cluster-wide watch hands to our code
    everywhere = ChildWatch(kube, object_path("apps/v1", "deployments", None), events.append)
    background = asyncio.create_task(everywhere.run())
    watches = ChildWatches(kube, refresh, clusterwide=False)
    watches.ensure(NS)
    try:
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(deployment("stranger", {"team": "other"})))
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(deployment("ours", OURS)))
        await eventually("the refresh of the owner", lambda: (NS, "owner") in refreshed)
        # The controller-manager writes both Deployments' status, and a scale changes the stranger again.
        cluster.kubectl("scale", "deployment", "stranger", "-n", NS, "--replicas=2")
        cluster.kubectl("label", "deployment", "ours", "-n", NS, "touched=yes")
        await eventually(
            "the label change", lambda: any(e["object"]["metadata"]["labels"].get("touched") for e in events)
        )
        await asyncio.sleep(1)  # a late event for the stranger would show up now
    finally:
        background.cancel()
        await watches.close()
    names = {e["object"]["metadata"]["name"] for e in events}
    assert names == {"ours"}, names
    assert set(refreshed) == {(NS, "owner")}
    stranger = cluster.get("deployment", "stranger", NS)
    assert stranger is not None and stranger["spec"]["replicas"] == 2  # it did change, unseen by the watch


async def test_an_expired_resource_version_makes_the_watch_list_again(cluster: Cluster, kube: KubeClient) -> None:
    body = {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "labelled", "namespace": NS, "labels": SELECTOR},
        "spec": {},
    }
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(body))
    # The ModelDeployment cache started long after revision 1, so a watch from there is 410 Gone ...
    path = object_path("pagoda.dev/v1alpha1", "modeldeployments", NS)
    with pytest.raises(KubeError) as raised:
        async for _ in kube.watch(path, SELECTOR, "1", timeout_seconds=5):
            pass
    assert raised.value.status == 410
    # ... and a watch resumed from there lists again, so the object still arrives.
    events: list[dict[str, Any]] = []
    watch = asyncio.create_task(ChildWatch(kube, path, events.append).run(resource_version="1"))
    try:
        await eventually("the relisted object", lambda: events)
    finally:
        watch.cancel()
    assert events[0]["type"] == "ADDED" and events[0]["object"]["metadata"]["name"] == "labelled"


async def test_the_running_operator_refreshes_the_owner_from_the_watch_alone(cluster: Cluster, tmp_path: Path) -> None:
    log = tmp_path / "kopf.log"
    # A reconcile timer far beyond the test: only the Deployment watch can bring the pod's readiness to the owner.
    with (
        own_namespace(cluster, "pagoda-watched") as watched,
        running_operator(watched, watched.namespace, log, {"PAGODA_RECONCILE_INTERVAL": "3600"}),
    ):
        watched.apply_md("seen")
        (pod,) = wait_for("the pod", lambda: watched.pods_of("seen"), 60)
        assert watched.md_condition("seen", "Ready").get("status") != "True"
        now = "2030-01-01T00:00:00Z"
        conditions = [{"type": t, "status": "True", "lastTransitionTime": now} for t in ("Ready", "ContainersReady")]
        watched.patch_pod_status(pod["metadata"]["name"], {"phase": "Running", "conditions": conditions})
        wait_for("Ready", lambda: watched.md_condition("seen", "Ready").get("status") == "True", 30)
    assert "watching /apis/apps/v1/namespaces/pagoda-watched/deployments?labelSelector=" in log.read_text()
