"""LoRA adapters on a real kube-apiserver, with the operator running (``kopf run``, 2 s reconcile interval).

Adapter delivery: the list lives in a ConfigMap, so changing ``spec.loraAdapters`` rewrites the ConfigMap and leaves
the Deployment's pod template (and generation) alone. Adapter status: a pod of the rendered template runs here as a
real ``pagoda serve`` (``run_pod_locally``); the test plays the kubelet, copying the ConfigMap into the file the
engine reads when it chooses to, and the operator asks the pod ``GET /lora_adapters`` at its Ready IP.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from control_plane import CLUSTER_SCRIPT, Cluster, make_stories_adapter, run_pod_locally, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")]

NS = "pagoda-lora"
INTERVAL = 2.0  # the operator's PAGODA_RECONCILE_INTERVAL in running_operator


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A PEFT adapter of the built-in model."""
    return make_stories_adapter(tmp_path_factory.mktemp("adapters") / "sql")


def listed(cluster: Cluster, name: str) -> Any:
    """The adapter list in the ConfigMap (None while there is none)."""
    config_map = cluster.get("configmap", f"{name}-lora-adapters", NS)
    return json.loads(config_map["data"]["adapters.json"]) if config_map else None


def deployment(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.get("deployment", name, NS) or {}


def test_changing_the_adapter_list_rewrites_the_config_map_without_rolling_the_pods(cluster, operator) -> None:
    cluster.apply_md("roll", loraAdapters=[{"name": "sql", "source": "org/sql"}], maxLoras=2)
    wait_for("the adapter list", lambda: listed(cluster, "roll") == [{"name": "sql", "path": "org/sql"}], 60)
    before = wait_for("the Deployment", lambda: deployment(cluster, "roll"), 30)
    for adapters, paths in (
        ([{"name": "chat", "source": "hf://org/chat"}, {"name": "img", "source": "/opt/a"}], ["org/chat", "/opt/a"]),
        ([], []),  # LoRA stays on with an empty list, so emptying it does not roll the pods either
    ):
        cluster.apply_md("roll", loraAdapters=adapters, maxLoras=2)
        wait_for("the new list", lambda paths=paths: [a["path"] for a in listed(cluster, "roll")] == paths, 30)
        time.sleep(2 * INTERVAL)  # and a couple of periodic reconciles
        after = deployment(cluster, "roll")
        assert after["spec"]["template"] == before["spec"]["template"]
        assert after["metadata"]["generation"] == before["metadata"]["generation"]
    cluster.apply_md("roll")  # LoRA off: that does roll the pods (a flag and a mount fewer)
    wait_for("the ConfigMap to go", lambda: listed(cluster, "roll") is None, 30)
    generation = before["metadata"]["generation"]
    off = wait_for(
        "a new template", lambda: (d := deployment(cluster, "roll"))["metadata"]["generation"] > generation and d
    )
    assert "--enable-lora" not in off["spec"]["template"]["spec"]["containers"][0]["args"]


def test_an_adapter_name_given_twice_is_refused_at_admission(cluster) -> None:
    body = {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "twice"},
        "spec": {"loraAdapters": [{"name": "a", "source": "org/a"}, {"name": "a", "source": "org/b"}]},
    }
    result = cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=json.dumps(body), check=False)
    assert result.returncode != 0 and "Duplicate value" in result.stderr, result.stderr


def start_pod(cluster: Cluster, template: dict[str, Any], tmp_path: Path) -> Any:
    """Run the template's engine here (the ConfigMap mounted from ``tmp_path/lora``) and register it as a Ready pod
    at 127.0.0.1 and the engine's port, as a kubelet would report it."""
    volumes = {"model-cache": tmp_path / "cache", "lora-adapters": tmp_path / "lora"}
    for folder in volumes.values():
        folder.mkdir(exist_ok=True)
    extra_env = {"PAGODA_CACHE_DIR": str(Path.home() / ".cache" / "pagoda")}  # the machine's compiled kernels
    local = run_pod_locally(cluster, NS, template["spec"], volumes, extra_env, tmp_path / "engine.log")
    spec = json.loads(json.dumps(template["spec"]))
    spec["containers"][0]["ports"][0]["containerPort"] = local.server.port
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "served-0", **template["metadata"]}, "spec": spec}
    cluster.kubectl("apply", "-n", NS, "-f", "-", stdin=json.dumps(pod))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ready = [{"type": t, "status": "True", "lastTransitionTime": now} for t in ("Ready", "ContainersReady")]
    status = {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}], "conditions": ready}
    cluster.patch_pod_status("served-0", status)
    return local


def kubelet_sync(cluster: Cluster, tmp_path: Path) -> None:
    """What the kubelet does about a minute after the ConfigMap changed: the mounted file follows it."""
    content = cluster.get("configmap", "served-lora-adapters", NS)["data"]["adapters.json"]
    (tmp_path / "lora" / "adapters.json").write_text(content)


def lora_status(cluster: Cluster) -> tuple[dict[str, tuple[int, int]], dict[str, Any]]:
    status = (cluster.get("modeldeployment", "served", NS) or {}).get("status") or {}
    counts = {a["name"]: (a["loadedPods"], a["failedPods"]) for a in status.get("loraAdapters") or []}
    conditions = [c for c in status.get("conditions") or [] if c["type"] == "LoraAdaptersReady"]
    return counts, conditions[0] if conditions else {}


def test_the_status_says_which_adapters_the_ready_pods_have_loaded(cluster, operator, adapter, tmp_path) -> None:
    broken = {"name": "broken", "source": str(tmp_path / "no-such-adapter")}
    cluster.apply_md("served", replicas=0, loraAdapters=[{"name": "sql", "source": str(adapter)}, broken])
    template = wait_for("the Deployment", lambda: deployment(cluster, "served"), 60)["spec"]["template"]
    wait_for("the adapter list", lambda: listed(cluster, "served"), 30)
    (tmp_path / "lora").mkdir()
    kubelet_sync(cluster, tmp_path)  # a new pod mounts the current list
    local = start_pod(cluster, template, tmp_path)
    try:

        def reason(wanted: str) -> Any:
            counts, condition = lora_status(cluster)
            return condition.get("reason") == wanted and (counts, condition)

        counts, condition = wait_for("AdapterLoadFailed", lambda: reason("AdapterLoadFailed"), 60)
        assert counts == {"sql": (1, 0), "broken": (0, 1)} and condition["status"] == "False"
        assert "adapter broken failed to load on 1 of 1 ready pods" in condition["message"]
        assert "pod served-0" in condition["message"] and "not a local directory" in condition["message"]

        second = {"name": "sql-again", "source": str(adapter)}
        cluster.apply_md("served", replicas=0, loraAdapters=[{"name": "sql", "source": str(adapter)}, second])
        counts, _ = wait_for("AdapterPending", lambda: reason("AdapterPending"), 30)  # the pod has the old list
        assert counts == {"sql": (1, 0), "sql-again": (0, 0)}
        kubelet_sync(cluster, tmp_path)
        counts, condition = wait_for("AllAdaptersLoaded", lambda: reason("AllAdaptersLoaded"), 60)
        assert counts == {"sql": (1, 0), "sql-again": (1, 0)} and condition["status"] == "True"

        version = cluster.get("modeldeployment", "served", NS)["metadata"]["resourceVersion"]
        time.sleep(3 * INTERVAL)  # three periodic passes that ask the pod again and find nothing new
        assert cluster.get("modeldeployment", "served", NS)["metadata"]["resourceVersion"] == version
        assert deployment(cluster, "served")["spec"]["template"] == template
    finally:
        local.server.stop()
