"""LoRA adapters, without a cluster: the adapter list ConfigMap, the pod template that never depends on the list,
the spec rules the engine imposes, and the adapter status computed from what the Ready pods report."""

from __future__ import annotations

import datetime
import hashlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import ClientSession, web
from operator_helpers import OWNER, spec_of, validate_kubernetes

from pagoda_operator.builders import build_deployment, build_lora_config_map
from pagoda_operator.capabilities import check_capabilities
from pagoda_operator.lora_status import PodAdapters, lora_status, observe_pod_adapters
from pagoda_operator.spec import InvalidSpec
from pagoda_operator.status import compute_status, status_changes


def adapters_json(**spec: Any) -> list[dict[str, str]]:
    config_map = build_lora_config_map(spec_of(**spec), OWNER)
    validate_kubernetes(config_map)
    return json.loads(config_map["data"]["adapters.json"])


def template(**spec: Any) -> str:
    deployment = build_deployment(spec_of(**spec), OWNER)
    validate_kubernetes(deployment)
    return json.dumps(deployment["spec"]["template"], sort_keys=True)


def engine(**spec: Any) -> dict[str, Any]:
    return build_deployment(spec_of(**spec), OWNER)["spec"]["template"]["spec"]["containers"][0]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


# ---- delivery: the ConfigMap, the mount, the flags -----------------------------------------------------------


def test_the_adapter_list_names_each_source_as_the_engine_reads_it() -> None:
    sources = {
        "hub": ("org/sql", "org/sql"),
        "hub-url": ("hf://org/chat", "org/chat"),
        "claim": ("pvc://adapters/llama/sql", "/mnt/pvc/adapters/llama/sql"),
        "image": ("/opt/adapters/support", "/opt/adapters/support"),
        "bucket": ("s3://adapters/llama/sql", "s3://adapters/llama/sql"),
    }
    listed = adapters_json(loraAdapters=[{"name": n, "source": src} for n, (src, _) in sources.items()])
    assert listed == [{"name": n, "path": path} for n, (_, path) in sources.items()]


def test_the_config_map_is_a_child_like_the_others() -> None:
    config_map = build_lora_config_map(spec_of(loraAdapters=[]), OWNER)
    assert config_map["metadata"]["name"] == "llm-lora-adapters" and config_map["metadata"]["namespace"] == "team-a"
    assert config_map["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagoda-operator"
    assert config_map["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"
    assert json.loads(config_map["data"]["adapters.json"]) == []
    assert build_lora_config_map(spec_of(), OWNER) is None  # no loraAdapters: LoRA is off


def test_the_engine_reads_the_list_from_a_directory_mount_of_the_config_map() -> None:
    spec = {"loraAdapters": [{"name": "sql", "source": "org/sql"}], "maxLoras": 2, "maxLoraRank": 64}
    container = engine(**spec, maxCpuLoras=8)
    args = container["args"]
    lora = ["--enable-lora", "--lora-modules-file", "/etc/pagoda/lora/adapters.json"]
    assert args[args.index("--enable-lora") :][:9] == lora + ["--max-loras", "2", "--max-lora-rank", "64"] + [
        "--max-cpu-loras",
        "8",
    ]
    assert "--lora-modules" not in args and not any("sql" in a for a in args)
    # A directory mount: the kubelet refreshes it when the ConfigMap changes (a subPath mount never would).
    assert {"name": "lora-adapters", "mountPath": "/etc/pagoda/lora", "readOnly": True} in container["volumeMounts"]
    volumes = build_deployment(spec_of(**spec), OWNER)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "lora-adapters", "configMap": {"name": "llm-lora-adapters"}} in volumes


def test_without_lora_there_is_no_flag_and_no_mount() -> None:
    container = engine()
    assert not [a for a in container["args"] if "lora" in a]
    assert not [m for m in container["volumeMounts"] if m["name"] == "lora-adapters"]


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ([], [{"name": "a", "source": "org/a"}, {"name": "b", "source": "/opt/adapters/b"}]),
        ([{"name": "a", "source": "org/a"}], [{"name": "a", "source": "org/a-v2"}]),
        ([{"name": "a", "source": "pvc://models/a"}], [{"name": "b", "source": "pvc://models/b"}]),
        (
            [{"name": "a", "source": "pvc://x/a"}, {"name": "b", "source": "pvc://y/b"}],
            [{"name": "b", "source": "pvc://y/b"}, {"name": "a", "source": "pvc://x/a"}],
        ),
    ],
)
def test_changing_the_adapter_list_leaves_the_pod_template_alone(before: list, after: list) -> None:
    common = {"model": {"source": "pvc://models/base"}, "maxLoras": 2}
    assert template(**common, loraAdapters=before) == template(**common, loraAdapters=after)


def test_turning_lora_on_or_adding_a_claim_changes_the_pod_template() -> None:
    base = {"model": {"source": "pvc://models/base"}}
    assert template(**base) != template(**base, loraAdapters=[])  # LoRA on: a flag and a mount
    on_model_claim = template(**base, loraAdapters=[{"name": "a", "source": "pvc://models/a"}])
    on_new_claim = template(**base, loraAdapters=[{"name": "a", "source": "pvc://adapters/a"}])
    assert on_model_claim != on_new_claim  # the new claim must be mounted


def test_the_engine_may_fetch_hub_and_s3_adapters_itself() -> None:
    model = {"source": "org/base", "hfTokenSecretRef": {"name": "hub"}}
    assert env_of(engine(model=model))["PAGODA_OFFLINE"] == "1"  # without LoRA the cache is all it needs
    container = engine(model=model, loraAdapters=[{"name": "a", "source": "org/private-adapter"}])
    # the model still starts from the cache; a later list may name a Hub adapter, which the engine downloads
    assert env_of(container)["PAGODA_OFFLINE"] == "1" and env_of(container)["PAGODA_LORA_OFFLINE"] == "0"
    assert env_of(container)["HF_TOKEN"] == {"secretKeyRef": {"name": "hub", "key": "token"}}
    s3 = {"endpointUrl": "http://minio:9000", "credentialsSecretRef": {"name": "s3"}}
    container = engine(
        model={"source": "org/base", "s3": s3}, loraAdapters=[{"name": "a", "source": "s3://adapters/a"}]
    )
    assert env_of(container)["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
    assert container["envFrom"] == [{"secretRef": {"name": "s3"}}]


# ---- what the engine refuses is refused first ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"loraAdapters": [{"name": "a", "source": "org/a"}], "maxLoraRank": 12}, "spec.maxLoraRank"),
        ({"loraAdapters": [], "maxCpuLoras": 2}, "spec.maxCpuLoras"),  # below the default maxLoras, 4
        ({"loraAdapters": [], "maxLoras": 3, "maxCpuLoras": 2}, "spec.maxCpuLoras"),
        ({"maxCpuLoras": 8}, "spec.maxCpuLoras"),
        ({"loraAdapters": [{"name": "sql adapter", "source": "org/a"}]}, "spec.loraAdapters[0].name"),
        ({"loraAdapters": [{"name": "-sql", "source": "org/a"}]}, "spec.loraAdapters[0].name"),
        ({"loraAdapters": [{"name": "a" * 129, "source": "org/a"}]}, "spec.loraAdapters[0].name"),
        ({"model": {"source": "org/m", "s3": {"region": "eu"}}, "loraAdapters": []}, "spec.model.s3"),
    ],
)
def test_lora_fields_the_engine_would_refuse_are_invalid(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpec) as error:
        spec_of(**spec)
    assert error.value.field == field


def test_what_the_engine_accepts_parses() -> None:
    spec = spec_of(
        model={"source": "org/m", "s3": {"region": "eu"}},  # the S3 settings serve the adapter
        loraAdapters=[{"name": "org/sql@v2+fast:1", "source": "s3://adapters/sql"}],
        maxLoras=2,
        maxCpuLoras=2,
        maxLoraRank=256,
    )
    assert spec.lora_enabled and spec.lora_adapters[0].name == "org/sql@v2+fast:1"
    check_capabilities(spec)
    assert spec_of(loraAdapters=[]).lora_enabled and not spec_of().lora_enabled


@pytest.mark.parametrize("flag", ["--lora-modules-file", "--allow-runtime-lora-updates", "--max-cpu-loras"])
def test_lora_flags_come_from_the_spec_not_from_extra_args(flag: str) -> None:
    with pytest.raises(InvalidSpec, match="spec.loraAdapters|spec.maxCpuLoras"):
        check_capabilities(spec_of(loraAdapters=[], engine={"extraArgs": [flag, "x"]}))


# ---- the status from what the Ready pods report ----------------------------------------------------------------

SPEC = spec_of(loraAdapters=[{"name": "sql", "source": "org/sql"}, {"name": "chat", "source": "pvc://ad/chat"}])
SQL = {"name": "sql", "path": "org/sql", "origin": "file", "state": "loaded", "error": None}
CHAT = {"name": "chat", "path": "/mnt/pvc/ad/chat", "origin": "file", "state": "loaded", "error": None}
CHAT_FAILED = {**CHAT, "state": "failed", "error": "adapter rank 64 is above --max-lora-rank 16"}


def report(pod: str, *entries: dict[str, Any]) -> PodAdapters:
    return PodAdapters(pod, {e["name"]: e for e in entries})


OLD_CHAT = {**CHAT, "path": "/mnt/pvc/ad/old"}  # the list the pod read before the last change


@pytest.mark.parametrize(
    ("reports", "counts", "condition"),
    [
        ([report("p-0", SQL, CHAT), report("p-1", SQL, CHAT)], "sql 2/0 chat 2/0", "True AllAdaptersLoaded"),
        ([report("p-0", SQL, CHAT), report("p-1", SQL, CHAT_FAILED)], "sql 2/0 chat 1/1", "False AdapterLoadFailed"),
        ([report("p-0", SQL, CHAT), report("p-1", SQL)], "sql 2/0 chat 1/0", "False AdapterPending"),
        ([report("p-0", SQL, OLD_CHAT)], "sql 1/0 chat 0/0", "False AdapterPending"),
        ([report("p-0", SQL, CHAT), PodAdapters("p-1", None)], "sql 1/0 chat 1/0", "Unknown PodsNotAnswering"),
        ([], "sql 0/0 chat 0/0", "Unknown NoReadyPods"),
    ],
)
def test_adapter_status_counts_loaded_and_failed_pods(reports: list, counts: str, condition: str) -> None:
    status = compute_status(
        error=None,
        deployment=None,
        pods=[],
        previous={},
        generation=1,
        selector="",
        endpoint=None,
        now=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        lora=lora_status(SPEC, reports),
    )
    assert " ".join(f"{e['name']} {e['loadedPods']}/{e['failedPods']}" for e in status["loraAdapters"]) == counts
    (rendered,) = [c for c in status["conditions"] if c["type"] == "LoraAdaptersReady"]
    assert f"{rendered['status']} {rendered['reason']}" == condition


def test_a_failure_names_the_adapter_the_pods_and_the_engines_error() -> None:
    lora = lora_status(SPEC, [report("p-0", SQL, CHAT), report("p-1", SQL, CHAT_FAILED)])
    assert lora.adapters[1] == {
        "name": "chat",
        "loadedPods": 1,
        "failedPods": 1,
        "message": "pod p-1: adapter rank 64 is above --max-lora-rank 16",
    }
    assert lora.condition.message == (
        "adapter chat failed to load on 1 of 2 ready pods (pod p-1: adapter rank 64 is above --max-lora-rank 16)"
    )


def redacted(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry as an engine with an API key reports it to a caller without the key (the operator)."""
    digest = hashlib.sha256(entry["path"].encode()).hexdigest()
    error = "see the server log" if entry["error"] else None
    return {
        "name": entry["name"],
        "origin": entry["origin"],
        "state": entry["state"],
        "path_sha256": digest,
        "error": error,
    }


def test_pods_that_redact_paths_are_matched_by_the_paths_digest() -> None:
    lora = lora_status(SPEC, [report("p-0", redacted(SQL), redacted(CHAT)), report("p-1", redacted(CHAT_FAILED))])
    assert [(e["name"], e["loadedPods"], e["failedPods"]) for e in lora.adapters] == [("sql", 1, 0), ("chat", 1, 1)]
    assert lora_status(SPEC, [report("p-0", redacted(OLD_CHAT))]).adapters[1]["loadedPods"] == 0  # another source


def test_only_what_changed_is_written() -> None:
    status = {"readyReplicas": 1, "conditions": [{"type": "Ready"}], "loraAdapters": None}
    assert status_changes(status, status) == {}
    assert status_changes({**status, "loraAdapters": [{"name": "a"}]}, status) == {"loraAdapters": None}
    assert status_changes({}, {**status, "readyReplicas": 2}) == {"readyReplicas": 2, "conditions": [{"type": "Ready"}]}


# ---- asking the pods, over HTTP ------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[dict[str, int]]:
    """Three servers on 127.0.0.1: one answers like the engine, one with a 404, one with something else."""

    async def engine_like(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [SQL, CHAT_FAILED]})

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text="<html>not json</html>")

    runners, ports = [], {}
    for name, handler in (("engine", engine_like), ("old", None), ("proxy", garbage)):
        app = web.Application()
        if handler is not None:
            app.router.add_get("/lora_adapters", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        ports[name] = runner.addresses[0][1]
    yield ports
    for runner in runners:
        await runner.cleanup()


def pod(name: str, port: int, ready: bool = True) -> dict[str, Any]:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "127.0.0.1", "conditions": [condition]},
    }


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.asyncio
async def test_ready_pods_are_asked_and_only_the_engines_answer_counts(engines: dict[str, int]) -> None:
    pods = [
        pod("d-closed", closed_port()),
        pod("c-proxy", engines["proxy"]),
        pod("b-old", engines["old"]),
        pod("a-engine", engines["engine"]),
        pod("e-starting", engines["engine"], ready=False),
    ]
    async with ClientSession() as session:
        reports = await observe_pod_adapters(session, pods)
    assert [r.pod for r in reports] == ["a-engine", "b-old", "c-proxy", "d-closed"]  # Ready pods, by name
    assert reports[0].adapters == {"sql": SQL, "chat": CHAT_FAILED}
    assert [r.adapters for r in reports[1:]] == [None, None, None]
