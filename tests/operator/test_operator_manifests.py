"""Offline validation: rendered children against Kubernetes' schemas, examples against the CRD's own schema."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import (
    CRD_PATH,
    EXAMPLES,
    REPO,
    crd_openapi_schema,
    crd_validator,
    example_body,
    load_yaml,
    structural_problems,
    validate_kubernetes,
)

from pagoda_operator.builders import Owner, build_deployment, build_hpa, build_pdb, build_service
from pagoda_operator.capabilities import check_capabilities, engine_capabilities
from pagoda_operator.constants import GROUP, KIND, PLURAL, VERSION
from pagoda_operator.spec import InvalidSpec, parse_spec

VALID_EXAMPLES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
INVALID_EXAMPLES = sorted(p.name for p in (EXAMPLES / "invalid").glob("*.yaml"))
# cel-*: rejected by the CRD's CEL rules (x-kubernetes-validations), which only an API server evaluates
# (test_control_plane.py); offline, the operator's own mirror of each rule (parse_spec, or for a rule the engine's
# contract decides, check_capabilities) refuses them.
SCHEMA_INVALID = [name for name in INVALID_EXAMPLES if not name.startswith("cel-")]
CEL_INVALID = [name for name in INVALID_EXAMPLES if name.startswith("cel-")]


def rendered_children(body: dict[str, Any]) -> list[dict[str, Any]]:
    spec = parse_spec(body)
    owner = Owner.from_body(body)
    children = [
        build_deployment(spec, owner, include_replicas=True),
        build_deployment(spec, owner, include_replicas=False),
        build_service(spec, owner),
    ]
    optional = [build_hpa(spec, owner), build_pdb(spec, owner)]
    return children + [child for child in optional if child]


EXTRA_SPECS = [
    {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8, "targetWaitingRequests": 0.5}},
    {"gpus": 8, "quantization": "fp8", "modelCache": {"size": "100Gi"}, "service": {"type": "NodePort"}},
    {"quantization": "awq", "kvCacheDtype": "fp8_e5m2", "model": {"source": "pvc://models/qwen3-awq"}},
    {"apiKeySecretRef": {"name": "k"}, "engine": {"env": [{"name": "A", "value": "b"}], "imagePullPolicy": "Always"}},
    {"replicas": 3, "rollout": {"maxSurge": "25%", "maxUnavailable": "10%"}, "drainSeconds": 600},
]


def test_examples_exist_for_cpu_one_gpu_and_four_gpus_with_quantization_and_lora() -> None:
    bodies = [load_yaml(EXAMPLES / name)["spec"] for name in VALID_EXAMPLES]
    assert {b.get("gpus", 0) for b in bodies} == {0, 1, 4}
    four = next(b for b in bodies if b.get("gpus") == 4)
    assert four["quantization"] and four["loraAdapters"]
    assert "source" not in next(b for b in bodies if b.get("gpus") == 0)["model"]  # the built-in model


@pytest.mark.parametrize("name", VALID_EXAMPLES)
def test_every_example_matches_the_crd_schema_and_parses(name: str) -> None:
    body = load_yaml(EXAMPLES / name)
    assert body["apiVersion"] == f"{GROUP}/{VERSION}" and body["kind"] == KIND
    errors = sorted(crd_validator().iter_errors(body), key=str)
    assert not errors, [e.message for e in errors]
    parse_spec(example_body(name))


@pytest.mark.parametrize("name", SCHEMA_INVALID)
def test_invalid_examples_are_rejected_by_the_crd_schema(name: str) -> None:
    assert list(crd_validator().iter_errors(load_yaml(EXAMPLES / "invalid" / name)))


@pytest.mark.parametrize("name", CEL_INVALID)
def test_what_cel_rejects_the_operator_refuses_too(name: str) -> None:
    body = load_yaml(EXAMPLES / "invalid" / name)
    assert not list(crd_validator().iter_errors(body))  # the structural schema alone accepts it
    with pytest.raises(InvalidSpec):
        check_capabilities(parse_spec({**body, "metadata": {**body["metadata"], "namespace": "ns", "uid": "u"}}))


def test_unknown_spec_fields_are_rejected() -> None:
    body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": KIND, "metadata": {"name": "x"}, "spec": {"gpu": 1}}
    assert list(crd_validator().iter_errors(body))


@pytest.mark.parametrize("name", VALID_EXAMPLES)
def test_children_of_every_example_validate_strictly(name: str) -> None:
    for child in rendered_children(example_body(name)):
        validate_kubernetes(child)


@pytest.mark.parametrize("spec", EXTRA_SPECS)
def test_children_of_other_specs_validate_strictly(spec: dict[str, Any]) -> None:
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": spec}
    for child in rendered_children(body):
        validate_kubernetes(child)


def test_strict_validation_catches_a_misspelled_field() -> None:
    deployment = rendered_children(example_body("cpu-builtin.yaml"))[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(Exception, match="imagePullPolicyy"):
        validate_kubernetes(deployment)


def test_crd_is_a_valid_structural_crd_with_status_and_scale() -> None:
    crd = load_yaml(CRD_PATH)
    validate_kubernetes(crd)
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert crd["spec"]["scope"] == "Namespaced" and crd["spec"]["names"]["shortNames"]
    (version,) = crd["spec"]["versions"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    assert {c["name"] for c in version["additionalPrinterColumns"]} >= {
        "Model",
        "Ready",
        "Replicas",
        "GPUs",
        "Status",
        "Age",
    }
    assert structural_problems(crd_openapi_schema()) == []


def test_chart_carries_the_same_crd() -> None:
    chart_crd = CRD_PATH.parents[1] / "charts" / "pagoda" / "crds" / "modeldeployment.yaml"
    assert chart_crd.read_text() == CRD_PATH.read_text()


# ---- quantization and the KV-cache dtype in the schema -------------------------------------------------------------


def md(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": "m"}, "spec": spec}


@pytest.mark.parametrize(
    "spec",
    [
        {"gpus": 0, "quantization": "awq"},
        {"gpus": 0, "quantization": "gptq"},
        {"gpus": 0, "quantization": "fp8"},
        {"gpus": 1, "quantization": "gptq", "kvCacheDtype": "fp8_e4m3"},
        {"kvCacheDtype": "auto"},
        {"kvCacheDtype": "fp8_e5m2"},
    ],
)
def test_the_schema_takes_every_method_on_the_cpu_and_both_fp8_kv_cache_dtypes(spec: dict[str, Any]) -> None:
    assert not list(crd_validator().iter_errors(md(**spec)))


@pytest.mark.parametrize(
    "spec", [{"quantization": "bitsandbytes"}, {"kvCacheDtype": "fp8"}, {"kvCacheDtype": "int8"}, {"kvCacheDtype": 8}]
)
def test_the_schema_refuses_other_methods_and_kv_cache_dtypes(spec: dict[str, Any]) -> None:
    assert list(crd_validator().iter_errors(md(**spec)))


def test_the_quantization_enum_and_cel_rules_follow_the_engines_contract() -> None:
    # CEL cannot read the contract: the CRD repeats it, and this holds the two together
    schema = crd_openapi_schema()["properties"]["spec"]
    devices = engine_capabilities()["devices"]
    assert schema["properties"]["quantization"]["enum"] == ["awq", "gptq", "fp8", "int8"]
    assert set(schema["properties"]["quantization"]["enum"]) == set(devices["cpu"]["quantization"]) | set(
        devices["cuda"]["quantization"]
    )
    assert schema["properties"]["kvCacheDtype"]["enum"] == devices["cpu"]["kv_cache_dtypes"]
    assert "default" not in schema["properties"]["kvCacheDtype"]  # unset is auto, and stays out of stored resources
    rules = " ".join(rule["rule"] for rule in schema["x-kubernetes-validations"])
    cpu_only = set(devices["cpu"]["quantization"]) - set(devices["cuda"]["quantization"])
    assert cpu_only == {"int8"} and "self.quantization != 'int8' || self.gpus == 0" in rules
    without_tp = devices["cuda"]["quantization_without_tensor_parallel"]
    assert f"!(self.quantization in {without_tp!r}) || self.gpus <= 1" in rules  # ['awq', 'gptq']
    assert "self.gpus > 0" not in rules  # no method needs a GPU any more


def test_no_bitsandbytes_anywhere_in_the_operator_chart_or_crd() -> None:
    roots = [REPO / "crds", REPO / "charts", REPO / "operator" / "src"]
    files = [path for root in roots for path in root.rglob("*") if path.is_file() and "egg-info" not in str(path)]
    assert files and not [path for path in files if "bitsandbytes" in path.read_text(errors="ignore")]
