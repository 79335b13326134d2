"""Builders: table-driven checks from a spec to the Deployment, Service and HPA manifests."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import OWNER, spec_of

from pagoda_operator.builders import build_deployment, build_hpa, build_service, engine_args
from pagoda_operator.builders.deployment import CACHE_MOUNT
from pagoda_operator.constants import PRESTOP_SLEEP_SECONDS


def container(**spec: Any) -> dict[str, Any]:
    return build_deployment(spec_of(**spec), OWNER)["spec"]["template"]["spec"]["containers"][0]


def pod(**spec: Any) -> dict[str, Any]:
    return build_deployment(spec_of(**spec), OWNER)["spec"]["template"]["spec"]


ARG_CASES = [
    ({}, ["--host", "0.0.0.0", "--port", "8000", "--served-model-name", "llm", "--shutdown-timeout", "30"]),
    (
        {"model": {"source": "Qwen/Qwen3-0.6B", "servedModelName": "qwen"}, "maxModelLen": 4096, "maxNumSeqs": 64},
        ["Qwen/Qwen3-0.6B", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen"]
        + ["--max-model-len", "4096", "--max-num-seqs", "64", "--shutdown-timeout", "30"],
    ),
    (
        {
            "gpus": 4,
            "quantization": "fp8",
            "kvCacheDtype": "fp8_e4m3",
            "dtype": "float16",
            "gpuMemoryUtilization": 0.85,
            "enablePrefixCaching": False,
        },
        ["--host", "0.0.0.0", "--port", "8000", "--served-model-name", "llm", "--gpu-memory-utilization", "0.85"]
        + ["--dtype", "float16", "--no-enable-prefix-caching", "--tensor-parallel-size", "4", "--quantization", "fp8"]
        + ["--kv-cache-dtype", "fp8_e4m3", "--shutdown-timeout", "30"],
    ),
    (
        {"quantization": "awq", "kvCacheDtype": "auto"},  # auto is the engine's default: no flag
        ["--host", "0.0.0.0", "--port", "8000", "--served-model-name", "llm", "--quantization", "awq"]
        + ["--shutdown-timeout", "30"],
    ),
    (
        {
            "model": {"source": "pvc://models/base"},
            "gpus": 1,
            "loraAdapters": [{"name": "sql", "source": "pvc://adapters/sql"}, {"name": "chat", "source": "org/chat"}],
            "maxLoras": 2,
            "maxLoraRank": 32,
            "engine": {"extraArgs": ["--seed", "7"], "shutdownTimeoutSeconds": 60},
        },
        ["/mnt/pvc/models/base", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "llm"]
        + ["--tensor-parallel-size", "1", "--enable-lora", "--lora-modules-file", "/etc/pagoda/lora/adapters.json"]
        + ["--max-loras", "2", "--max-lora-rank", "32", "--shutdown-timeout", "60", "--seed", "7"],
    ),
]


@pytest.mark.parametrize(("spec", "args"), ARG_CASES)
def test_engine_args(spec: dict[str, Any], args: list[str]) -> None:
    assert engine_args(spec_of(**spec)) == args
    assert container(**spec)["command"] == ["pagoda", "serve"]
    assert container(**spec)["args"] == args


def test_probes_wait_for_the_model_and_check_liveness_separately() -> None:
    c = container()
    assert c["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


@pytest.mark.parametrize(
    ("spec", "requests", "limits"),
    [
        ({}, None, None),
        ({"resources": {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}}}, {"cpu": "2"}, {"memory": "4Gi"}),
        ({"gpus": 2}, {"nvidia.com/gpu": 2}, {"nvidia.com/gpu": 2}),
        (
            {"gpus": 1, "resources": {"limits": {"memory": "32Gi", "nvidia.com/gpu": 8}}},
            {"nvidia.com/gpu": 1},
            {"memory": "32Gi", "nvidia.com/gpu": 1},
        ),
    ],
)
def test_resources_and_gpu_limits(spec: dict[str, Any], requests: Any, limits: Any) -> None:
    resources = container(**spec)["resources"]
    assert resources.get("requests") == requests
    assert resources.get("limits") == limits


@pytest.mark.parametrize(
    ("spec", "cache_volume"),
    [
        ({}, {"name": "model-cache", "emptyDir": {}}),
        ({"modelCache": {"size": "50Gi"}}, {"name": "model-cache", "emptyDir": {"sizeLimit": "50Gi"}}),
        (
            {"modelCache": {"type": "pvc", "claimName": "hf"}},
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf"}},
        ),
    ],
)
def test_volumes_shm_and_model_cache(spec: dict[str, Any], cache_volume: dict[str, Any]) -> None:
    volumes = pod(**spec)["volumes"]
    assert volumes[0] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    assert volumes[1] == cache_volume
    mounts = container(**spec)["volumeMounts"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in mounts
    assert {"name": "model-cache", "mountPath": CACHE_MOUNT} in mounts


def test_model_and_adapter_claims_are_mounted_read_only_once_each() -> None:
    spec = {
        "model": {"source": "pvc://models/base"},
        "gpus": 1,
        "loraAdapters": [{"name": "a", "source": "pvc://models/a"}, {"name": "b", "source": "pvc://adapters/b"}],
    }
    volumes = pod(**spec)["volumes"][2:4]
    assert volumes == [
        {"name": "pvc-0", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        {"name": "pvc-1", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}},
    ]
    assert container(**spec)["volumeMounts"][2:4] == [
        {"name": "pvc-0", "mountPath": "/mnt/pvc/models", "readOnly": True},
        {"name": "pvc-1", "mountPath": "/mnt/pvc/adapters", "readOnly": True},
    ]


def test_api_key_comes_from_the_secret_never_from_args() -> None:
    c = container(apiKeySecretRef={"name": "keys", "key": "token"})
    assert {"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "token"}}} in c["env"]
    assert not any("key" in a for a in c["args"])


def test_node_placement() -> None:
    toleration = {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    p = pod(gpus=1, nodeSelector={"gpu": "h100"}, tolerations=[toleration], affinity=affinity)
    assert p["nodeSelector"] == {"gpu": "h100"}
    assert p["affinity"] == affinity
    assert p["tolerations"] == [toleration, {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    cpu_pod = pod()
    assert "nodeSelector" not in cpu_pod and "tolerations" not in cpu_pod and "affinity" not in cpu_pod


def test_runs_as_non_root_without_privileges() -> None:
    p = pod()
    assert p["securityContext"]["runAsNonRoot"] is True
    assert p["securityContext"]["runAsUser"] != 0
    c = p["containers"][0]["securityContext"]
    assert c == {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize("timeout", [0, 30, 600])
def test_grace_period_outlasts_prestop_plus_engine_shutdown(timeout: int) -> None:
    p = pod(engine={"shutdownTimeoutSeconds": timeout})
    assert p["containers"][0]["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}
    assert p["terminationGracePeriodSeconds"] > PRESTOP_SLEEP_SECONDS + timeout


@pytest.mark.parametrize(
    ("spec", "include", "replicas"),
    [
        ({"replicas": 3}, True, 3),
        ({"replicas": 3}, False, 3),
        ({"replicas": 0}, False, 0),
        ({"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}, True, 2),
        ({"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}, False, None),
    ],
)
def test_replicas_rule(spec: dict[str, Any], include: bool, replicas: int | None) -> None:
    deployment = build_deployment(spec_of(**spec), OWNER, include_replicas=include)
    assert deployment["spec"].get("replicas") == replicas


def test_every_child_carries_labels_and_a_controller_owner_reference() -> None:
    spec = spec_of(autoscaling={"enabled": True, "mode": "hpa", "maxReplicas": 3})
    children = [build_deployment(spec, OWNER), build_service(spec, OWNER), build_hpa(spec, OWNER)]
    for child in children:
        meta = child["metadata"]
        assert meta["name"] == "llm" and meta["namespace"] == "team-a"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pagoda-operator"
        assert meta["labels"]["app.kubernetes.io/instance"] == "llm"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "pagoda.dev/v1alpha1",
                "kind": "ModelDeployment",
                "name": "llm",
                "uid": "1234-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    deployment = children[0]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert children[1]["spec"]["selector"] == selector


def test_service_exposes_port_named_http() -> None:
    service = build_service(spec_of(service={"type": "LoadBalancer", "port": 80}), OWNER)
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]


@pytest.mark.parametrize(
    ("autoscaling", "expected"),
    [
        (None, None),
        ({"enabled": False}, None),
        ({"enabled": True, "mode": "builtin", "maxReplicas": 3}, None),
        ({"enabled": True, "maxReplicas": 3}, None),  # builtin is the default mode
        ({"enabled": True, "mode": "hpa", "minReplicas": 1, "maxReplicas": 4, "targetWaitingRequests": 2.5}, "2500m"),
        ({"enabled": True, "mode": "hpa", "maxReplicas": 4}, "5"),
    ],
)
def test_hpa_only_in_hpa_mode_on_waiting_requests_per_pod(autoscaling: Any, expected: str | None) -> None:
    hpa = build_hpa(spec_of(autoscaling=autoscaling) if autoscaling else spec_of(), OWNER)
    if expected is None:
        assert hpa is None
        return
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"] == {"name": "vllm:num_requests_waiting"}
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": expected}
    assert hpa["spec"]["behavior"]["scaleDown"] == {"stabilizationWindowSeconds": 300}
