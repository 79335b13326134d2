"""End to end on a real cluster: install the chart, deploy the CPU example, chat through the Service, scale, delete.

Environment: KUBECONFIG or PAGODA_E2E_CLUSTER (see conftest.py); PAGODA_E2E_OPERATOR_IMAGE and
PAGODA_E2E_ENGINE_IMAGE name images the cluster can pull (with kind: `kind load docker-image`). e2e/run-kind.sh does
all of it on a fresh kind cluster.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster_tools import get_json, kube_context_args, run, tool, wait_until

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "pagoda-e2e"
RELEASE = "pagoda-e2e"
OPERATOR_IMAGE = os.environ.get("PAGODA_E2E_OPERATOR_IMAGE", "ghcr.io/pagoda-dev/pagoda-operator:0.1.0")
ENGINE_IMAGE = os.environ.get("PAGODA_E2E_ENGINE_IMAGE", "ghcr.io/pagoda-dev/pagoda-engine:0.1.0")


def condition(md: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (md.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


@pytest.fixture(scope="module")
def operator() -> Iterator[None]:
    repository, _, tag = OPERATOR_IMAGE.rpartition(":")
    run("kubectl", "create", "namespace", NAMESPACE, check=False)
    run(
        "helm",
        "upgrade",
        "--install",
        RELEASE,
        str(REPO / "charts" / "pagoda"),
        "--namespace",
        NAMESPACE,
        "--set",
        f"operator.image.repository={repository}",
        "--set",
        f"operator.image.tag={tag}",
        "--set",
        "operator.image.pullPolicy=IfNotPresent",
        "--set",
        f"engineImage={ENGINE_IMAGE}",
        "--set",
        "operator.reconcileInterval=5",
        "--wait",
        "--timeout",
        "5m",
    )
    yield
    run("kubectl", "delete", "modeldeployments", "--all", "-n", NAMESPACE, "--wait=true", check=False, timeout=300)
    run("helm", "uninstall", RELEASE, "--namespace", NAMESPACE, check=False)
    run("kubectl", "delete", "namespace", NAMESPACE, "--wait=false", check=False)


@pytest.fixture(scope="module")
def model(operator: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    body = yaml.safe_load((REPO / "crds" / "examples" / "cpu-builtin.yaml").read_text())
    body["metadata"]["namespace"] = NAMESPACE
    body["spec"].setdefault("engine", {})["imagePullPolicy"] = "IfNotPresent"
    manifest = tmp_path_factory.mktemp("e2e") / "md.yaml"
    manifest.write_text(yaml.safe_dump(body))
    run("kubectl", "apply", "-f", str(manifest))
    yield body["metadata"]["name"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_model_becomes_ready_and_answers_a_chat_completion(model: str) -> None:
    md = wait_until(
        lambda: (
            (m := get_json("modeldeployment", model, "-n", NAMESPACE))
            and condition(m, "Ready").get("status") == "True"
            and m
        ),
        timeout=600,
        what=f"ModelDeployment {model} Ready",
    )
    assert md["status"]["endpoint"].startswith(f"http://{model}.{NAMESPACE}.svc")
    openai = pytest.importorskip("openai")
    port = free_port()
    forward = subprocess.Popen(
        [tool("kubectl"), *kube_context_args(), "port-forward", "-n", NAMESPACE, f"service/{model}", f"{port}:8000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)
        reply = client.chat.completions.create(
            model=md["spec"]["model"]["servedModelName"],
            messages=[{"role": "user", "content": "Once upon a time"}],
            max_tokens=16,
            temperature=0,
        )
        assert reply.choices[0].message.content
    finally:
        forward.terminate()
        forward.wait(timeout=10)


def test_scale_subresource_scales_the_deployment(model: str) -> None:
    run("kubectl", "scale", "modeldeployment", model, "-n", NAMESPACE, "--replicas=2")
    wait_until(
        lambda: get_json("modeldeployment", model, "-n", NAMESPACE).get("status", {}).get("readyReplicas") == 2,
        timeout=600,
        what="2 ready replicas",
    )
    assert get_json("deployment", model, "-n", NAMESPACE)["spec"]["replicas"] == 2


def test_deleting_the_model_removes_its_children(model: str) -> None:
    run("kubectl", "delete", "modeldeployment", model, "-n", NAMESPACE, "--wait=true", timeout=300)
    for kind in ("deployment", "service"):
        wait_until(
            lambda k=kind: run("kubectl", "get", k, model, "-n", NAMESPACE, check=False).returncode != 0,
            timeout=120,
            what=f"{kind} {model} deleted",
        )
