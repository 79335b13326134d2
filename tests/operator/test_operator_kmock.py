"""The operator run for real: kopf in-process against kmock's Kubernetes emulator over HTTP.

Only what does not depend on API-server semantics: the emulator has no server-side apply (field managers, dry
runs), no garbage collector and no controllers. Reconciling children is tested against a real kube-apiserver in
test_reconcile_cluster.py; here, a resource the engine cannot serve gets a status and no children, and a
Deployment's status reaches its owner without the timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import pytest_asyncio
import yaml

from pagoda_operator.builders import Owner, build_deployment
from pagoda_operator.kube import KubeClient
from pagoda_operator.reconcile import refresh_owner_status
from pagoda_operator.spec import parse_spec

NS = "default"
MD_PATH = f"/apis/pagoda.dev/v1alpha1/namespaces/{NS}/modeldeployments"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
SERVICES = f"/api/v1/namespaces/{NS}/services"
HPAS = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers"
PODS = f"/api/v1/namespaces/{NS}/pods"
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def write_kubeconfig(path: Path, server: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester", "namespace": NS}}],
        "current-context": "kmock",
    }
    path.write_text(yaml.safe_dump(config))


def declare_resources(emulator: kmock.KubernetesEmulator) -> None:
    info = kmock.ResourceInfo
    emulator.resources["pagoda.dev/v1alpha1/modeldeployments"] = info(
        kind="ModelDeployment",
        singular="modeldeployment",
        namespaced=True,
        verbs=VERBS,
        subresources={"status", "scale"},
    )
    emulator.resources["apps/v1/deployments"] = info(
        kind="Deployment", namespaced=True, verbs=VERBS, subresources={"status", "scale"}
    )
    emulator.resources["v1/services"] = info(kind="Service", namespaced=True, verbs=VERBS)
    emulator.resources["v1/pods"] = info(kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"})
    emulator.resources["v1/events"] = info(kind="Event", namespaced=True, verbs=VERBS)
    emulator.resources["autoscaling/v2/horizontalpodautoscalers"] = info(
        kind="HorizontalPodAutoscaler", namespaced=True, verbs=VERBS
    )
    # kopf watches namespaces and CRDs to notice new ones; both exist in every real cluster.
    emulator.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs=VERBS)
    emulator.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS
    )


@pytest_asyncio.fixture()
async def cluster(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[kmock.KubernetesEmulator]:
    """The emulator with the operator running against it (through a kubeconfig, as in production).

    Cluster-wide, like the chart's default: kmock 0.8 cannot serve ``GET /api/v1/namespaces`` (it parses the path
    as a namespaced one), which kopf needs when it watches a list of namespaces.
    """
    declare_resources(kmock)
    write_kubeconfig(tmp_path / "kubeconfig", str(kmock.url))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.setenv("PAGODA_RECONCILE_INTERVAL", "0.5")
    main = importlib.import_module("pagoda_operator.main")  # registers the handlers in kopf's default registry
    assert main.RECONCILE_INTERVAL == 0.5, "pagoda_operator.main was imported before PAGODA_RECONCILE_INTERVAL was set"
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready))
    await asyncio.wait_for(ready.wait(), 20)
    yield kmock
    stop.set()
    try:
        await asyncio.wait_for(asyncio.shield(task), 1.5)
    except TimeoutError:
        # kopf 1.45 may keep a timer that was re-spawned during shutdown sleeping in its error backoff; cancel it.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def get(emulator: kmock.KubernetesEmulator, path: str) -> dict[str, Any] | None:
    response = await emulator.get(path)
    return None if response.status == 404 else await response.json()


async def eventually(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Poll an async check until it returns something truthy; fail with the last value after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value or asyncio.get_running_loop().time() > deadline:
            assert value, f"condition not met within {timeout}s"
            return value
        await asyncio.sleep(0.1)


def model_deployment(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "ModelDeployment",
        # kmock assigns neither uid nor resourceVersion; kopf's patches test the latter.
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1, "resourceVersion": "1"},
        "spec": spec,
    }


async def create(emulator: kmock.KubernetesEmulator, body: dict[str, Any]) -> None:
    response = await emulator.post(MD_PATH, json=body)
    assert response.status < 300, await response.text()


async def patch(emulator: kmock.KubernetesEmulator, path: str, body: dict[str, Any]) -> None:
    response = await emulator.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"})
    assert response.status < 300, await response.text()


def condition(body: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    conditions = ((body or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


async def _with_status(emulator: kmock.KubernetesEmulator, name: str) -> dict[str, Any] | None:
    md = await get(emulator, f"{MD_PATH}/{name}")
    return md if md and condition(md, "Ready") else None


async def _events(emulator: kmock.KubernetesEmulator, reason: str) -> list[dict[str, Any]]:
    # Events as posted: kmock stores objects by name and kopf names events with generateName, so only the request
    # log keeps them all.
    posted = [request.data for request in emulator[f"post /api/v1/namespaces/{NS}/events"]]
    return [e for e in posted if isinstance(e, dict) and e.get("reason") == reason]


async def test_invalid_resource_is_degraded_naming_the_field_and_gets_no_children(
    cluster: kmock.KubernetesEmulator,
) -> None:
    await create(cluster, model_deployment("bad", autoscaling={"enabled": True, "minReplicas": 4, "maxReplicas": 2}))
    md = await eventually(lambda: _with_status(cluster, "bad"))
    degraded = condition(md, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.autoscaling.minReplicas" in degraded["message"]
    assert condition(md, "Ready")["reason"] == "InvalidSpec"
    assert md["status"].get("servedModelName") is None  # nothing is served
    assert await get(cluster, f"{DEPLOYMENTS}/bad") is None
    warnings = await eventually(lambda: _events(cluster, "InvalidSpec"))
    await asyncio.sleep(1.5)  # three periodic reconciles later ...
    assert len(await _events(cluster, "InvalidSpec")) == len(warnings)  # ... the warning was not repeated


async def test_deployment_status_change_refreshes_the_owner_status_without_the_timer(
    kmock: kmock.KubernetesEmulator,
) -> None:
    # What the operator's Deployment event handler calls; here without kopf, so no timer can be the one that did it.
    declare_resources(kmock)
    body = model_deployment("llm")
    await create(kmock, body)
    deployment = build_deployment(parse_spec(body), Owner.from_body(body))
    deployment["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    assert (await kmock.post(DEPLOYMENTS, json=deployment)).status < 300
    kube = KubeClient(kopf.ConnectionInfo(server=str(kmock.url)))
    try:
        await refresh_owner_status(kube, NS, "llm")
    finally:
        await kube.close()
    md = await get(kmock, f"{MD_PATH}/llm")
    assert condition(md, "Ready")["status"] == "True"
    assert md["status"]["readyReplicas"] == 1
    assert await get(kmock, f"{SERVICES}/llm") is None  # a status refresh never creates children
