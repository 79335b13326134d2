"""Shared helpers of the operator tests: loading the CRD and examples, validating objects offline, and the spec and
pod of one test resource (``OWNER``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from pagoda_operator.builders import Owner, build_deployment
from pagoda_operator.spec import ModelDeploymentSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "modeldeployment.yaml"
EXAMPLES = REPO / "crds" / "examples"
# kubernetes-validate 1.37 ships schemas 1.25 ... 1.37, so both versions the issue names are checked exactly.
KUBERNETES_VERSIONS = ("1.30", "1.37")
# The ModelDeployment the builder tests render.
OWNER = Owner(name="llm", namespace="team-a", uid="1234-uid")


def load_yaml(path: Path) -> dict[str, Any]:
    """One YAML document as a dict."""
    return yaml.safe_load(path.read_text())


def crd_openapi_schema() -> dict[str, Any]:
    """The v1alpha1 openAPIV3Schema of the ModelDeployment CRD."""
    crd = load_yaml(CRD_PATH)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def _to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """Translate the OpenAPI v3.0 subset used in CRDs to a draft-4 JSON schema.

    Differences handled: the API server rejects unknown fields under kubectl's default strict field validation,
    so objects that declare ``properties`` and do not preserve unknown fields get ``additionalProperties: false``;
    ``x-kubernetes-*`` keys are dropped (draft 4 ignores them anyway). Draft 4 is chosen because OpenAPI 3.0 uses
    its boolean ``exclusiveMinimum``.
    """
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if "properties" in node:
        out["properties"] = {k: _to_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _to_json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = _to_json_schema(node["items"])
    if "anyOf" in node:
        out["anyOf"] = [_to_json_schema(v) for v in node["anyOf"]]
    return out


def structural_problems(node: dict[str, Any], path: str = "") -> list[str]:
    """Nodes that break Kubernetes' structural-schema rule: every field needs a type, unless int-or-string."""
    problems: list[str] = []
    if "type" not in node and not node.get("x-kubernetes-int-or-string") and not path.endswith("anyOf"):
        problems.append(path or "<root>")
    for key, child in (node.get("properties") or {}).items():
        problems += structural_problems(child, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        problems += structural_problems(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        problems += structural_problems(node["items"], f"{path}[]")
    return problems


def crd_validator() -> jsonschema.Draft4Validator:
    """A validator of ModelDeployment objects against the CRD's own schema."""
    schema = _to_json_schema(copy.deepcopy(crd_openapi_schema()))
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def validate_kubernetes(obj: dict[str, Any]) -> None:
    """Strict kubernetes-validate for every version in ``KUBERNETES_VERSIONS``; raises on the first error."""
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def example_body(name: str, uid: str = "uid-1", namespace: str = "default") -> dict[str, Any]:
    """An example resource as the API server would hand it to the operator (namespace and uid filled in)."""
    body = load_yaml(EXAMPLES / name)
    body["metadata"].update(namespace=namespace, uid=uid)
    return body


def spec_of(**spec: Any) -> ModelDeploymentSpec:
    """``parse_spec`` of ``OWNER`` with this spec."""
    return parse_spec({"metadata": {"name": OWNER.name, "namespace": OWNER.namespace, "uid": OWNER.uid}, "spec": spec})


def pod_spec(**spec: Any) -> dict[str, Any]:
    """The pod template spec of ``OWNER``'s Deployment for this spec; the Deployment passes ``validate_kubernetes``."""
    deployment = build_deployment(spec_of(**spec), OWNER)
    validate_kubernetes(deployment)
    return deployment["spec"]["template"]["spec"]
