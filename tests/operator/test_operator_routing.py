"""spec.routing and autoscaling mode keda, offline: parsing, the CEL rules' mirror, the InferencePool,
InferenceObjective and ScaledObject builders (checked against the vendored CRDs' schemas), the engine pods' routing
labels and KV events, the capability contract, and the status conditions of a cluster without those CRDs."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from operator_helpers import OWNER, _to_json_schema, load_yaml, spec_of, validate_kubernetes

from pagoda_operator.builders import build_children, build_deployment, selector_labels
from pagoda_operator.builders.keda import build_scaled_object, engine_query, held_query
from pagoda_operator.builders.routing import build_inference_objective, build_inference_pool
from pagoda_operator.capabilities import check_capabilities, engine_capabilities
from pagoda_operator.reconcile import integration_conditions
from pagoda_operator.spec import InvalidSpec
from pagoda_operator.spec_routing import PROMETHEUS_URL_ENV

THIRD_PARTY = Path(__file__).parent / "thirdparty_crds"
PROMETHEUS = "http://prometheus.monitoring:9090"
POOL = {"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "epp"}}}
KEDA = {"enabled": True, "mode": "keda", "minReplicas": 0, "maxReplicas": 4, "keda": {"serverAddress": PROMETHEUS}}
KV_EVENTS_JSON = (
    '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
    '"replay_endpoint":"tcp://*:5558","topic":"kv-events"}'
)


def vendored_validator(file: str) -> jsonschema.Draft4Validator:
    """A strict validator of objects of a vendored third-party CRD (its only version's schema)."""
    (version,) = load_yaml(THIRD_PARTY / file)["spec"]["versions"]
    return jsonschema.Draft4Validator(_to_json_schema(copy.deepcopy(version["schema"]["openAPIV3Schema"])))


def assert_valid(file: str, obj: dict[str, Any]) -> None:
    errors = [e.message for e in vendored_validator(file).iter_errors(obj)]
    assert not errors, errors


def test_without_routing_there_are_no_routing_children_labels_or_kv_events() -> None:
    spec = spec_of()
    assert not spec.routing.inference_pool and not spec.routing.kv_events
    children = build_children(spec, OWNER)
    assert children["InferencePool"] is None and children["InferenceObjective"] is None
    assert children["ScaledObject"] is None
    deployment = build_deployment(spec, OWNER)
    assert deployment["spec"]["template"]["metadata"]["labels"] == deployment["metadata"]["labels"]
    assert "--kv-events-config" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_inference_pool_selects_this_models_pods_on_the_engine_port() -> None:
    pool = build_inference_pool(spec_of(routing=POOL), OWNER)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == OWNER.name and pool["metadata"]["ownerReferences"][0]["controller"]
    assert pool["spec"] == {
        "selector": {"matchLabels": selector_labels(OWNER)},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {
            "name": "epp",
            "kind": "Service",
            "group": "",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    }
    assert_valid("inference.networking.k8s.io_inferencepools.yaml", pool)


def test_the_endpoint_picker_reference_is_taken_as_given() -> None:
    ref = {"name": "picker", "port": 9100, "kind": "Service", "group": "", "failureMode": "FailOpen"}
    pool = build_inference_pool(spec_of(routing={"inferencePool": {"enabled": True, "endpointPickerRef": ref}}), OWNER)
    assert pool["spec"]["endpointPickerRef"] == {**ref, "port": {"number": 9100}}


def test_a_disabled_pool_renders_nothing_even_with_a_picker() -> None:
    spec = spec_of(routing={"inferencePool": {"enabled": False, "endpointPickerRef": {"name": "epp"}}})
    assert build_inference_pool(spec, OWNER) is None


def test_the_objective_refers_to_the_pool_with_its_priority() -> None:
    objective = build_inference_objective(spec_of(routing={**POOL, "objective": {"priority": -3}}), OWNER)
    assert objective["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    assert objective["spec"] == {
        "priority": -3,
        "poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": OWNER.name},
    }
    assert_valid("inference.networking.x-k8s.io_inferenceobjectives.yaml", objective)
    assert build_inference_objective(spec_of(routing=POOL), OWNER) is None


def test_pool_members_get_endpoint_picker_labels_on_the_template_only() -> None:
    plain, routed = build_deployment(spec_of(), OWNER), build_deployment(spec_of(routing=POOL), OWNER)
    assert routed["spec"]["selector"] == plain["spec"]["selector"]  # immutable: never touched by routing
    labels = routed["spec"]["template"]["metadata"]["labels"]
    assert labels == {
        **plain["spec"]["template"]["metadata"]["labels"],
        "inference.networking.k8s.io/engine-type": "vllm",
        "llm-d.ai/engine-type": "vllm",
        "llm-d.ai/inferenceServing": "true",
        "llm-d.ai/role": "both",
    }
    assert selector_labels(OWNER).items() <= labels.items()
    validate_kubernetes(routed)


def test_kv_events_add_the_engine_flag_and_named_ports() -> None:
    deployment = build_deployment(spec_of(routing={"kvEvents": True}), OWNER)
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    args = engine["args"]
    assert args[args.index("--kv-events-config") + 1] == KV_EVENTS_JSON
    assert json.loads(KV_EVENTS_JSON)["endpoint"] == "tcp://*:5557"
    assert engine["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
        {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"},
    ]
    validate_kubernetes(deployment)


def test_the_scaled_object_queries_only_this_models_series() -> None:
    spec = spec_of(model={"servedModelName": "qwen"}, autoscaling={**KEDA, "targetWaitingRequests": 2.5})
    scaled = build_scaled_object(spec, OWNER)
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    body = scaled["spec"]
    assert body["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm"}
    assert (body["minReplicaCount"], body["maxReplicaCount"]) == (0, 4)
    assert (body["pollingInterval"], body["cooldownPeriod"]) == (15, 300)
    assert body["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 0},
        "scaleDown": {"stabilizationWindowSeconds": 300},
    }
    triggers = {t["name"]: t for t in body["triggers"]}
    assert all(t["type"] == "prometheus" and t["metadata"]["serverAddress"] == PROMETHEUS for t in triggers.values())
    assert triggers["waiting-requests"]["metadata"] == {
        "serverAddress": PROMETHEUS,
        "query": 'sum(vllm:num_requests_waiting{namespace="team-a",service="llm",model_name="qwen"})',
        "threshold": "2.5",
        "activationThreshold": "0",
    }
    running = triggers["running-requests"]["metadata"]
    assert running["query"] == 'sum(vllm:num_requests_running{namespace="team-a",service="llm",model_name="qwen"})'
    assert (running["threshold"], running["activationThreshold"]) == ("256", "0")  # the engine's batch size
    held = triggers["router-held-requests"]["metadata"]
    assert held["query"] == 'sum(pagoda_router_held_requests{model_namespace="team-a",model_deployment="llm"})'
    assert (held["threshold"], held["activationThreshold"]) == ("2.5", "0")
    assert_valid("keda.sh_scaledobjects.yaml", scaled)


def test_keda_settings_and_stabilization_reach_the_scaled_object() -> None:
    keda = {"serverAddress": PROMETHEUS, "activationWaitingRequests": 1.5, "pollingInterval": 5, "cooldownPeriod": 60}
    autoscaling = {**KEDA, "keda": keda, "scaleUpStabilizationSeconds": 30, "scaleDownStabilizationSeconds": 600}
    body = build_scaled_object(spec_of(maxNumSeqs=32, autoscaling=autoscaling), OWNER)["spec"]
    assert (body["pollingInterval"], body["cooldownPeriod"]) == (5, 60)
    assert body["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 30
    triggers = {t["name"]: t["metadata"] for t in body["triggers"]}
    assert triggers["waiting-requests"]["activationThreshold"] == "1.5"
    assert triggers["running-requests"]["threshold"] == "32"


def test_promql_label_values_are_quoted_literals() -> None:
    spec = spec_of(model={"servedModelName": 'a"b\\c'})
    assert engine_query("m", spec, OWNER) == 'sum(m{namespace="team-a",service="llm",model_name="a\\"b\\\\c"})'
    assert held_query(OWNER) == 'sum(pagoda_router_held_requests{model_namespace="team-a",model_deployment="llm"})'


def test_the_operator_leaves_replicas_to_keda() -> None:
    spec = spec_of(autoscaling=KEDA)
    assert build_deployment(spec, OWNER, include_replicas=True)["spec"]["replicas"] == 0  # created at minReplicas
    assert "replicas" not in build_deployment(spec, OWNER, include_replicas=False)["spec"]
    children = build_children(spec, OWNER)
    assert children["HorizontalPodAutoscaler"] is None and children["ScaledObject"] is not None


def test_the_prometheus_address_defaults_to_the_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROMETHEUS_URL_ENV, "http://from-env:9090")
    assert spec_of(autoscaling={**KEDA, "keda": {}}).autoscaling.keda.server_address == "http://from-env:9090"
    assert spec_of(autoscaling=KEDA).autoscaling.keda.server_address == PROMETHEUS  # the field wins
    monkeypatch.delenv(PROMETHEUS_URL_ENV)
    with pytest.raises(InvalidSpec) as error:
        spec_of(autoscaling={k: v for k, v in KEDA.items() if k != "keda"})
    assert error.value.field == "spec.autoscaling.keda.serverAddress"


def test_min_replicas_zero_in_builtin_and_keda_modes() -> None:
    assert spec_of(autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 2}).min_replicas == 0
    assert spec_of(autoscaling=KEDA).min_replicas == 0


# The CRD's CEL rules on these fields, mirrored by parse_spec (the API server's side: test_routing_cluster.py).
CEL_MIRROR = [
    ({"autoscaling": {"enabled": True, "mode": "hpa", "minReplicas": 0, "maxReplicas": 2}}, "minReplicas"),
    ({"routing": {"objective": {"priority": 1}}}, "spec.routing.objective"),
    ({"routing": {"inferencePool": {"enabled": True}}}, "spec.routing.inferencePool.endpointPickerRef"),
    ({"autoscaling": {"enabled": True, "mode": "hpa", "keda": {}}}, "spec.autoscaling.keda"),
    # and what the schema says, for bodies that never passed an API server
    ({"autoscaling": {"enabled": True, "mode": "knative"}}, "spec.autoscaling.mode"),
    (
        {
            "routing": {
                **POOL,
                "inferencePool": {**POOL["inferencePool"], "endpointPickerRef": {"name": "e", "failureMode": "x"}},
            }
        },
        "failureMode",
    ),
    ({"autoscaling": {**KEDA, "keda": {"serverAddress": PROMETHEUS, "activationWaitingRequests": -1}}}, "activation"),
    ({"enablePrefixCaching": False, "routing": {"kvEvents": True}}, "spec.routing.kvEvents"),
]


@pytest.mark.parametrize(("spec", "field"), CEL_MIRROR)
def test_what_the_crd_refuses_parse_spec_refuses_naming_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpec) as error:
        spec_of(**spec)
    assert field in error.value.field


def test_hpa_mode_with_zero_min_replicas_is_fine_while_autoscaling_is_off() -> None:
    assert spec_of(autoscaling={"enabled": False, "mode": "hpa", "minReplicas": 0}).replicas == 1


def test_kv_events_need_an_engine_that_publishes_them() -> None:
    contract = copy.deepcopy(engine_capabilities())
    contract["serve_flags"] = [f for f in contract["serve_flags"] if f != "--kv-events-config"]
    with pytest.raises(InvalidSpec) as error:
        check_capabilities(spec_of(routing={"kvEvents": True}), contract)
    assert error.value.field == "spec.routing.kvEvents"
    contract["serve_flags"].append("--kv-events-config")
    check_capabilities(spec_of(routing={"kvEvents": True}), contract)
    with pytest.raises(InvalidSpec, match="spec.routing.kvEvents"):  # set from the field, never by hand
        check_capabilities(spec_of(engine={"extraArgs": ["--kv-events-config", "{}"]}), contract)


def test_conditions_say_which_kinds_the_cluster_lacks() -> None:
    spec = spec_of(routing={**POOL, "objective": {"priority": 1}}, autoscaling=KEDA)
    missing = integration_conditions(spec, {"InferencePool", "InferenceObjective", "ScaledObject"}, {})
    assert [(c.type, c.status, c.reason) for c in missing] == [
        ("RoutingAvailable", False, "RoutingUnavailable"),
        ("KedaAvailable", False, "KedaUnavailable"),
    ]
    assert "InferencePool, InferenceObjective" in missing[0].message and "KEDA" in missing[1].message
    applied = integration_conditions(spec, set(), {})
    assert [(c.type, c.status, c.reason) for c in applied] == [
        ("RoutingAvailable", True, "Applied"),
        ("KedaAvailable", True, "Applied"),
    ]
    assert integration_conditions(spec_of(), {"ScaledObject"}, {}) == []  # not wanted: no condition


def test_a_pass_that_applied_nothing_keeps_the_live_conditions() -> None:
    spec = spec_of(routing=POOL)
    live = {
        "conditions": [{"type": "RoutingAvailable", "status": "False", "reason": "RoutingUnavailable", "message": "m"}]
    }
    (kept,) = integration_conditions(spec, None, live)
    assert (kept.type, kept.status, kept.reason, kept.message) == ("RoutingAvailable", False, "RoutingUnavailable", "m")
    assert integration_conditions(spec_of(), None, live) == []  # routing turned off: the condition goes
