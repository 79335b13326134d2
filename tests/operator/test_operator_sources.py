"""Model sources and the capability contract on the operator's side: what the CRD accepts, the engine serves.

The contract test runs the engine's own `pagoda capabilities --json` and holds the operator's copy equal to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from typing import Any

import pytest
from operator_helpers import EXAMPLES, crd_openapi_schema, example_body, pod_spec, spec_of

from pagoda_operator.builders.deployment import CACHE_MOUNT, CHAT_TEMPLATE_MOUNT, cpu_threads
from pagoda_operator.capabilities import SPEC_FLAGS, check_capabilities, engine_capabilities
from pagoda_operator.spec import ENGINE_DEFAULT_MAX_LORAS, LORA_RANKS, InvalidSpec, parse_spec
from pagoda_operator.status import STARTUP_REASONS, compute_conditions


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


# ---- the contract -----------------------------------------------------------------------------------------------


def test_the_operators_copy_of_the_contract_is_the_engines_own() -> None:
    engine = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "capabilities", "--json"], capture_output=True, text=True, check=True
    )
    copy = resources.files("pagoda_operator").joinpath("engine_capabilities.json").read_text()
    assert json.loads(copy) == json.loads(engine.stdout), (
        "the engine's capabilities changed: refresh operator/src/pagoda_operator/engine_capabilities.json with "
        "`pagoda capabilities > operator/src/pagoda_operator/engine_capabilities.json` and review the CRD"
    )


def test_every_flag_the_operator_derives_from_a_field_is_an_engine_flag() -> None:
    assert set(SPEC_FLAGS) <= set(engine_capabilities()["serve_flags"])


def refused(**spec: Any) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        check_capabilities(spec_of(**spec))
    return info.value


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ({"gpus": 9}, "spec.gpus", "tensor parallelism 9; this engine serves at most 8"),
        ({"gpus": 8}, "spec.gpus", "intermediate_size 172 is not divisible by 8"),  # the built-in model
        ({"gpus": 2, "loraAdapters": []}, "spec.loraAdapters", "not serve LoRA adapters with tensor parallelism"),
        ({"gpus": 1, "quantization": "int8"}, "spec.quantization", "int8 runs on CPU replicas only"),
        ({"gpus": 2, "quantization": "gptq"}, "spec.quantization", "gptq checkpoints with tensor parallelism"),
        ({"engine": {"extraArgs": ["--no-such-flag"]}}, "spec.engine.extraArgs[0]", "not a flag of pagoda serve"),
        ({"engine": {"extraArgs": ["--seed", "1", "--port=9"]}}, "spec.engine.extraArgs[2]", "pod's port"),
        ({"engine": {"extraArgs": ["--max-model-len", "99"]}}, "spec.engine.extraArgs[0]", "spec.maxModelLen"),
        ({"engine": {"extraArgs": ["-q", "int8"]}}, "spec.engine.extraArgs[0]", "long form"),
    ],
)
def test_specs_outside_the_contract_are_refused_naming_the_field(spec: dict, field: str, words: str) -> None:
    error = refused(**spec)
    assert error.field == field and words in error.message, error


def test_specs_inside_the_contract_pass() -> None:
    for spec in (
        {},
        {"gpus": 1},
        {"gpus": 4},
        {"gpus": 8, "model": {"source": "Qwen/Qwen3-0.6B"}},
        {"quantization": "int8"},
        {"quantization": "awq", "kvCacheDtype": "fp8_e5m2"},
        {"gpus": 1, "quantization": "gptq", "kvCacheDtype": "fp8_e4m3"},
        {"gpus": 8, "quantization": "fp8", "model": {"source": "Qwen/Qwen3-0.6B"}},
        {"model": {"source": "s3://models/qwen3"}},
        {"model": {"source": "hf://Qwen/Qwen3-0.6B", "revision": "main"}},
        {"engine": {"extraArgs": ["--max-num-batched-tokens", "8192", "--seed=3", "--seed", "-1"]}},
    ):
        check_capabilities(spec_of(**spec))  # (a negative number is a flag's value, not a flag)


def test_lora_is_refused_only_where_the_contract_says_the_engine_has_none() -> None:
    lora = spec_of(loraAdapters=[{"name": "a", "source": "org/a"}], maxLoraRank=256)
    check_capabilities(lora)  # this engine serves LoRA up to rank 256
    without = {**engine_capabilities(), "lora": {"supported": False}}
    for spec in (lora, spec_of(loraAdapters=[])):  # an empty list turns LoRA on too
        with pytest.raises(InvalidSpec, match="does not serve LoRA") as info:
            check_capabilities(spec, without)
        assert info.value.field == "spec.loraAdapters"
    check_capabilities(spec_of(), without)
    smaller = {**engine_capabilities(), "lora": {"supported": True, "max_rank": 64, "ranks": [8, 16, 32, 64]}}
    with pytest.raises(InvalidSpec, match=r"256 is not a rank this engine serves \(8, 16, 32, 64\)") as info:
        check_capabilities(lora, smaller)
    assert info.value.field == "spec.maxLoraRank"


def test_the_operators_lora_rules_are_the_engines() -> None:
    # spec.py and the CRD repeat the engine's ranks and its --max-loras default (CEL cannot read the contract)
    lora = engine_capabilities()["lora"]
    assert list(LORA_RANKS) == lora["ranks"] and lora["default_max_loras"] == ENGINE_DEFAULT_MAX_LORAS
    schema = crd_openapi_schema()["properties"]["spec"]
    assert schema["properties"]["maxLoraRank"]["enum"] == lora["ranks"]
    rules = " ".join(rule["rule"] for rule in schema.get("x-kubernetes-validations", []))
    assert f"self.maxCpuLoras >= (has(self.maxLoras) ? self.maxLoras : {lora['default_max_loras']})" in rules


def test_the_flagship_example_is_refused_until_the_engine_serves_it() -> None:
    spec = parse_spec(example_body("four-gpus-quantized-lora.yaml"))
    contract = engine_capabilities()
    # tensor parallelism 4, FP8 weights and an FP8 KV cache are served; LoRA adapters with tensor parallelism are not
    with pytest.raises(InvalidSpec) as info:
        check_capabilities(spec, contract)
    assert info.value.field == "spec.loraAdapters"
    check_capabilities(spec, {**contract, "lora": {**contract["lora"], "tensor_parallel": True}})


# ---- model sources in the Deployment -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "args"),
    [
        ({"source": "Qwen/Qwen3-0.6B", "revision": "c0ffee0"}, ["Qwen/Qwen3-0.6B", "--revision", "c0ffee0"]),
        ({"source": "s3://models/qwen3"}, ["s3://models/qwen3"]),
    ],
)
def test_hub_and_s3_models_are_downloaded_by_an_init_container_first(model: dict, args: list[str]) -> None:
    pod = pod_spec(model=model)
    (download,) = pod["initContainers"]
    engine = pod["containers"][0]
    assert download["command"] == ["pagoda", "download"] and download["args"] == args
    assert engine["args"][: len(args)] == args  # the engine names the same model, and finds it in the cache
    assert env_of(engine)["PAGODA_OFFLINE"] == "1" and "PAGODA_OFFLINE" not in env_of(download)
    for container in (download, engine):
        assert env_of(container)["HF_HOME"] == f"{CACHE_MOUNT}/huggingface"
        assert env_of(container)["PAGODA_CACHE_DIR"] == CACHE_MOUNT
        assert {"name": "model-cache", "mountPath": CACHE_MOUNT} in container["volumeMounts"]
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_local_and_builtin_models_need_no_download() -> None:
    for model in ({}, {"source": "pvc://models/qwen3"}, {"source": "/opt/models/qwen3"}):
        pod = pod_spec(model=model)
        assert "initContainers" not in pod and "PAGODA_OFFLINE" not in env_of(pod["containers"][0])


def test_tokens_and_s3_credentials_come_from_secrets() -> None:
    pod = pod_spec(model={"source": "org/private", "hfTokenSecretRef": {"name": "hub"}})
    for container in (*pod["initContainers"], *pod["containers"]):
        assert env_of(container)["HF_TOKEN"] == {"secretKeyRef": {"name": "hub", "key": "token"}}
    s3 = {"source": "s3://models/q", "s3": {"endpointUrl": "http://minio:9000", "credentialsSecretRef": {"name": "s3"}}}
    pod = pod_spec(model=s3)
    for container in (*pod["initContainers"], *pod["containers"]):
        assert container["envFrom"] == [{"secretRef": {"name": "s3"}}]
        assert env_of(container)["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"


def test_the_download_container_asks_for_no_gpu() -> None:
    pod = pod_spec(model={"source": "org/m"}, gpus=1, resources={"limits": {"cpu": "4", "memory": "16Gi"}})
    download = pod["initContainers"][0]
    assert download["resources"] == {"limits": {"cpu": "4", "memory": "16Gi"}}
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize(("limit", "threads"), [("2", 2), (2, 2), ("500m", 1), ("1500m", 2), ("3.5", 4), (None, None)])
def test_torch_threads_follow_the_cpu_limit(limit: Any, threads: Any) -> None:
    resources = {"limits": {"cpu": limit}} if limit is not None else {}
    assert cpu_threads(resources) == threads
    engine = pod_spec(resources=resources)["containers"][0]
    assert env_of(engine).get("OMP_NUM_THREADS") == (str(threads) if threads else None)


def test_a_users_own_thread_setting_wins() -> None:
    engine = pod_spec(resources={"limits": {"cpu": "8"}}, engine={"env": [{"name": "OMP_NUM_THREADS", "value": "6"}]})
    assert [item["value"] for item in engine["containers"][0]["env"] if item["name"] == "OMP_NUM_THREADS"] == ["6"]


def test_a_chat_template_is_passed_inline_or_mounted_from_a_config_map() -> None:
    inline = pod_spec(engine={"chatTemplate": {"inline": "{{ messages[0]['content'] }}"}})["containers"][0]
    assert inline["args"][inline["args"].index("--chat-template") + 1] == "{{ messages[0]['content'] }}"
    pod = pod_spec(engine={"chatTemplate": {"configMapKeyRef": {"name": "templates", "key": "llama.jinja"}}})
    engine = pod["containers"][0]
    assert engine["args"][engine["args"].index("--chat-template") + 1] == f"{CHAT_TEMPLATE_MOUNT}/llama.jinja"
    volume = next(v for v in pod["volumes"] if v["name"] == "chat-template")
    assert volume["configMap"] == {"name": "templates", "items": [{"key": "llama.jinja", "path": "llama.jinja"}]}


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"model": {"source": "s3://models/q", "revision": "main"}}, "spec.model.revision"),
        ({"model": {"source": "org/m", "s3": {"region": "eu"}}}, "spec.model.s3"),
        ({"model": {"source": "s3://"}}, "spec.model.source"),
        ({"engine": {"chatTemplate": {}}}, "spec.engine.chatTemplate"),
    ],
)
def test_source_fields_that_do_not_fit_are_invalid(spec: dict, field: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        spec_of(**spec)
    assert info.value.field == field


# ---- start-up failures in the status -----------------------------------------------------------------------------


def failing_pod(terminated: dict, init: bool = False, waiting: str = "CrashLoopBackOff") -> dict:
    status = {
        "name": "model-download" if init else "engine",
        "image": "engine:1",
        "state": {"waiting": {"reason": waiting}},
    }
    status["lastState"] = {"terminated": {"exitCode": 2, **terminated}}
    key = "initContainerStatuses" if init else "containerStatuses"
    return {"metadata": {"name": "llm-0"}, "status": {key: [status]}}


DEPLOYMENT = {"metadata": {"generation": 1}, "spec": {"replicas": 1}, "status": {"observedGeneration": 1}}


@pytest.mark.parametrize("reason", STARTUP_REASONS)
@pytest.mark.parametrize("init", [False, True])
def test_the_engines_termination_message_becomes_the_degraded_reason(reason: str, init: bool) -> None:
    pod = failing_pod({"message": f"{reason}: model 'org/m': the cause"}, init=init)
    degraded = compute_conditions(None, DEPLOYMENT, [pod])[2]
    assert (degraded.status, degraded.reason) == (True, reason)
    assert degraded.message.endswith("model 'org/m': the cause")
    assert ("model-download" in degraded.message) == init


def test_an_oom_kill_is_out_of_memory_and_other_crashes_keep_their_last_lines() -> None:
    degraded = compute_conditions(None, DEPLOYMENT, [failing_pod({"reason": "OOMKilled", "exitCode": 137})])[2]
    assert degraded.reason == "OutOfMemory"
    crash = failing_pod({"message": "Traceback ...\nRuntimeError: boom"})
    degraded = compute_conditions(None, DEPLOYMENT, [crash])[2]
    assert degraded.reason == "ModelLoadFailed" and "RuntimeError: boom" in degraded.message


def test_a_container_running_again_is_not_degraded_by_its_last_failure() -> None:
    pod = failing_pod({"message": "ModelLoadFailed: model 'org/m': cannot reach the Hub"})
    pod["status"]["containerStatuses"][0]["state"] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    assert compute_conditions(None, DEPLOYMENT, [pod])[2].status is False


def test_examples_name_only_served_or_refused_features() -> None:
    assert (EXAMPLES / "hub-model-cpu.yaml").is_file()
