"""What the API server accepts, the engine serves: the CRD and the operator against a real kube-apiserver.

Every example in crds/examples/ is applied with kubectl. It is either refused (at admission by the schema or a CEL
rule, or by the operator with an InvalidSpec status naming the field), or its Deployment's pod is run here, init
container first, and the engine it starts answers the openai client. None is accepted and then fails.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import openai
import pytest
import torch
import yaml
from control_plane import CLUSTER_SCRIPT, REPO, Cluster, condition_of, run_pod_locally, wait_for
from fake_hub import FakeHub
from pooling_checkpoints import build_bge_folder
from tiny_checkpoints import build_tiny_checkpoint

from pagoda.config import builtin_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")]

EXAMPLES = REPO / "crds" / "examples"
NS = "pagoda-test"
HF_TOKEN = "hf_test_token"
API_KEY = "k-123"
# Examples the engine cannot serve yet; the operator must refuse them naming this field (see the capability contract).
REFUSED = {"four-gpus-quantized-lora.yaml": "spec.loraAdapters"}
VALID = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
INVALID = sorted(p.name for p in (EXAMPLES / "invalid").glob("*.yaml"))


@pytest.fixture(scope="module")
def cluster(cluster: Cluster) -> Cluster:
    """The module's namespace (``conftest.py``) with the Secrets the examples name: the Hub token, the API key."""
    cluster.kubectl("create", "secret", "generic", "hf-token", f"--from-literal=token={HF_TOKEN}", "-n", NS)
    key = f"--from-literal=api-key={API_KEY}"
    cluster.kubectl("create", "secret", "generic", "pagoda-api-key", key, "-n", NS)
    return cluster


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    """A tiny random Qwen3 with the built-in model's tokenizer and chat template: what the examples' PVC holds."""
    folder = build_tiny_checkpoint(
        "qwen3",
        tmp_path_factory.mktemp("pvc") / "Qwen3-0.6B",
        torch.bfloat16,
        vocab_size=512,
        max_position_embeddings=8192,
    )
    for name in (
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        shutil.copy(builtin_model_path() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def bge_folder(tmp_path_factory) -> Path:
    """A tiny bge-shaped sentence-transformers embedder (its pooling config in 1_Pooling/): the embeddings example's."""
    return build_bge_folder(tmp_path_factory.mktemp("bert-raw"), tmp_path_factory.mktemp("bge"))


@pytest.fixture(scope="module")
def public_hub(bge_folder: Path) -> Iterator[FakeHub]:
    """The Hub as anonymous clients see it: the public embedding model the examples name."""
    files = {p.relative_to(bge_folder).as_posix(): p.read_bytes() for p in bge_folder.rglob("*") if p.is_file()}
    with FakeHub() as hub:
        hub.add_commit("BAAI/bge-small-en-v1.5", files)
        yield hub


@pytest.fixture(scope="module")
def hub(qwen3_folder: Path) -> Iterator[FakeHub]:
    with FakeHub(token=HF_TOKEN) as hub:
        hub.add_commit("Qwen/Qwen3-0.6B", {p.name: p.read_bytes() for p in qwen3_folder.iterdir()})
        yield hub


def example(manifest: Path, name: Optional[str] = None, **spec: Any) -> dict[str, Any]:
    """The example ``manifest`` in this module's namespace; renamed to ``name`` and ``spec`` merged into its spec."""
    body = yaml.safe_load(manifest.read_text())
    body["metadata"]["namespace"] = NS
    if name is not None:
        body["metadata"]["name"] = name
    if spec:
        body["spec"].update(spec)
    return body


def apply(cluster: Cluster, body: dict[str, Any], validate: bool = True):
    """``kubectl apply`` of ``body``: the result (not checked) and the resource's name."""
    args = ["apply", "-f", "-"] + ([] if validate else ["--validate=false"])  # no kubectl-side check: the server's
    return cluster.kubectl(*args, stdin=json.dumps(body), check=False), body["metadata"]["name"]


def invalid_spec(cluster: Cluster, name: str) -> Any:
    """The message of the resource's Degraded condition (InvalidSpec is the only Degraded these tests expect)."""
    return cluster.md_condition(name, "Degraded").get("message")


@pytest.mark.parametrize("name", INVALID)
def test_invalid_examples_are_refused_at_admission(cluster: Cluster, name: str) -> None:
    result, md = apply(cluster, example(EXAMPLES / "invalid" / name), validate=False)
    assert result.returncode != 0 and "is invalid" in result.stderr, result.stderr
    if name.startswith("cel-"):  # a CEL rule's own message, not a generic schema error
        comment = (EXAMPLES / "invalid" / name).read_text().splitlines()[0]
        assert 'Invalid value: "object"' in result.stderr, result.stderr
        assert "CEL" in comment
    assert cluster.get("modeldeployment", md, NS) is None


def local_volumes(tmp_path: Path, qwen3_folder: Path, pod: dict[str, Any]) -> dict[str, Path]:
    """A local folder for every volume of the pod: the cache, each model claim, a ConfigMap."""
    volumes: dict[str, Path] = {}
    for volume in pod.get("volumes") or []:
        folder = tmp_path / volume["name"]
        folder.mkdir(exist_ok=True)
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim == "models":
            shutil.copytree(qwen3_folder, folder / "Qwen3-0.6B", dirs_exist_ok=True)
        volumes[volume["name"]] = folder
    return volumes


@pytest.mark.parametrize("name", VALID)
def test_every_example_is_refused_or_serves(
    cluster, operator, hub, public_hub, bge_folder, qwen3_folder, tmp_path, name: str
) -> None:
    result, md = apply(cluster, example(EXAMPLES / name))
    assert result.returncode == 0, result.stderr

    def outcome():
        degraded = condition_of(cluster.get("modeldeployment", md, NS) or {}, "Degraded")
        if degraded.get("reason") == "InvalidSpec":
            return "refused", degraded
        deployment = cluster.get("deployment", md, NS)
        return ("rendered", deployment) if deployment else None

    kind, detail = wait_for(f"the operator to act on {name}", outcome, 60)
    if name in REFUSED:
        assert kind == "refused" and REFUSED[name] in detail["message"], detail
        return
    assert kind == "rendered", detail
    pod = detail["spec"]["template"]["spec"]
    # HF_ENDPOINT: the test double of the Hub. PAGODA_CACHE_DIR: the machine's own kernel build cache, not the cache
    # volume's (a fresh folder here), so that each pod does not compile the CPU kernels again (~40 s each).
    spec = cluster.get("modeldeployment", md, NS)["spec"]
    hub_url = hub.url if "hfTokenSecretRef" in spec["model"] else public_hub.url
    extra_env = {"HF_ENDPOINT": hub_url, "PAGODA_CACHE_DIR": str(Path.home() / ".cache" / "pagoda")}
    volumes = local_volumes(tmp_path, qwen3_folder, pod)
    local = run_pod_locally(cluster, NS, pod, volumes, extra_env, tmp_path / "engine.log")
    try:
        body = cluster.get("modeldeployment", md, NS)
        served = body["spec"]["model"].get("servedModelName", md)
        key = API_KEY if "apiKeySecretRef" in body["spec"] else "unused"
        client = openai.OpenAI(base_url=local.server.base_url, api_key=key, max_retries=0)
        if body["spec"].get("task", "generate") == "embed":
            assert_embeds_as_sentence_transformers(client, served, bge_folder)
            return
        chat = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=4
        )
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    finally:
        local.server.stop()


def assert_embeds_as_sentence_transformers(client: openai.OpenAI, served: str, folder: Path) -> None:
    """The pod serves the Hub's embedder with its own pooling (mean, from 1_Pooling/config.json) and normalisation."""
    from sentence_transformers import SentenceTransformer

    texts = ["the cat sat on the mat", "what is the sun"]
    got = torch.tensor([d.embedding for d in client.embeddings.create(model=served, input=texts).data])
    want = torch.from_numpy(SentenceTransformer(str(folder), device="cpu").encode(texts))
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.9999


def test_a_spec_outside_the_engines_contract_is_admitted_then_refused_naming_the_field(cluster, operator) -> None:
    engine = {"extraArgs": ["--max-num-batched-tokens", "64", "--not-a-flag"]}
    result, md = apply(cluster, example(EXAMPLES / "cpu-builtin.yaml", "bad-flag", engine=engine))
    assert result.returncode == 0, result.stderr
    degraded = wait_for("InvalidSpec", lambda: invalid_spec(cluster, md), 60)
    assert "spec.engine.extraArgs[2]" in degraded and "--not-a-flag" in degraded
    assert cluster.get("deployment", md, NS) is None


def test_a_model_that_cannot_be_had_shows_its_reason_in_the_status(cluster, operator) -> None:
    # No kubelet here: the pod's status is patched as the kubelet would write it after `pagoda download` failed.
    assert apply(cluster, example(EXAMPLES / "hub-model-cpu.yaml", "private-model", replicas=1))[0].returncode == 0
    pod = wait_for("the Deployment's pod", lambda: cluster.pods_of("private-model"), 60)[0]["metadata"]["name"]
    message = "Unauthorized: model 'Qwen/Qwen3-0.6B': the Hub refused access (HTTP 401): the model is private or gated"
    status = {
        "initContainerStatuses": [
            {
                "name": "model-download",
                "image": "engine",
                "imageID": "",
                "ready": False,
                "restartCount": 3,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": message}},
            }
        ]
    }
    cluster.patch_pod_status(pod, status)

    def degraded():
        found = cluster.md_condition("private-model", "Degraded")
        return found if found.get("reason") == "Unauthorized" else None

    found = wait_for("the Unauthorized reason in the status", degraded, 60)
    assert found["status"] == "True" and "container model-download" in found["message"]
    assert "the Hub refused access (HTTP 401)" in found["message"]


def test_the_model_column_shows_the_served_name_even_when_it_is_defaulted(cluster, operator) -> None:
    body = example(EXAMPLES / "hub-model-cpu.yaml", "defaulted-name")
    body["spec"]["model"].pop("servedModelName", None)
    assert apply(cluster, body)[0].returncode == 0

    def served():
        status = (cluster.get("modeldeployment", "defaulted-name", NS) or {}).get("status") or {}
        return status.get("servedModelName")

    # Without servedModelName, clients send the resource's name.
    assert wait_for("the served model name in the status", served, 60) == "defaulted-name"
    table = cluster.kubectl("get", "modeldeployment", "defaulted-name", "-n", NS).stdout.splitlines()
    row = dict(zip(table[0].split(), table[1].split()))
    assert row["MODEL"] == "defaulted-name"


def test_two_gpus_are_one_pod_whose_two_workers_serve(cluster, operator, tmp_path) -> None:
    # The rendered pod of gpus: 2, run here: no GPU, so the engine's two workers split the model over gloo on the
    # CPU, with the pod's environment (NCCL and gloo on the loopback) and flags.
    result, md = apply(cluster, example(EXAMPLES / "cpu-builtin.yaml", "two-gpus", gpus=2))
    assert result.returncode == 0, result.stderr
    assert "shmSize" not in cluster.get("modeldeployment", md, NS)["spec"]  # no CRD default: sized by gpus
    deployment = wait_for("the Deployment", lambda: cluster.get("deployment", md, NS), 60)
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == "2"
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod["volumes"]
    env = {item["name"]: item.get("value") for item in engine["env"]}
    assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "lo"
    extra_env = {"PAGODA_CACHE_DIR": str(Path.home() / ".cache" / "pagoda")}
    volumes = {v["name"]: tmp_path / v["name"] for v in pod["volumes"]}
    for folder in volumes.values():
        folder.mkdir()
    local = run_pod_locally(cluster, NS, pod, volumes, extra_env, tmp_path / "engine.log")
    try:
        client = openai.OpenAI(base_url=local.server.base_url, api_key="unused", max_retries=0)
        completion = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=4)
        assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 4
        assert "rank 1" in local.server.log()  # the second worker took part
    finally:
        local.server.stop()


@pytest.mark.parametrize(
    ("name", "change", "field", "words"),
    [
        ("tp-eight", {"gpus": 8}, "spec.gpus", "intermediate_size 172 is not divisible by 8"),
        ("tp-lora", {"gpus": 2, "loraAdapters": []}, "spec.loraAdapters", "set gpus to 1, or remove loraAdapters"),
    ],
)
def test_tensor_parallel_specs_the_engine_cannot_serve_are_refused_naming_the_field(
    cluster, operator, name: str, change: dict[str, Any], field: str, words: str
) -> None:
    result, md = apply(cluster, example(EXAMPLES / "cpu-builtin.yaml", name, **change))
    assert result.returncode == 0, result.stderr  # admitted: only the operator knows the engine's contract
    degraded = wait_for("InvalidSpec", lambda: invalid_spec(cluster, md), 60)
    assert field in degraded and words in degraded, degraded
    assert cluster.get("deployment", md, NS) is None


# Quantization and the KV-cache dtype at admission (a server-side dry run: the schema and CEL rules run, nothing is
# stored, so the operator never sees these). None applied is an error; (field, words) of a refusal otherwise.
ADMISSION = [
    ("awq-on-cpu", {"gpus": 0, "quantization": "awq"}, None),
    ("gptq-on-one-gpu", {"gpus": 1, "quantization": "gptq"}, None),
    ("fp8-on-four-gpus", {"gpus": 4, "quantization": "fp8"}, None),
    ("fp8-e5m2-kv-cache", {"kvCacheDtype": "fp8_e5m2"}, None),
    ("fp8-e4m3-kv-cache-awq", {"quantization": "awq", "kvCacheDtype": "fp8_e4m3"}, None),
    (
        "gptq-on-two-gpus",
        {"gpus": 2, "quantization": "gptq"},
        "awq and gptq checkpoints are not served with tensor parallelism yet (gpus 0 or 1)",
    ),
    ("int8-on-one-gpu", {"gpus": 1, "quantization": "int8"}, "quantization int8 runs on CPU replicas only (gpus 0)"),
    ("unknown-kv-cache-dtype", {"kvCacheDtype": "fp8"}, 'spec.kvCacheDtype: Unsupported value: "fp8"'),
    ("bitsandbytes", {"quantization": "bitsandbytes"}, 'spec.quantization: Unsupported value: "bitsandbytes"'),
]


@pytest.mark.parametrize(("name", "spec", "refusal"), ADMISSION, ids=[case[0] for case in ADMISSION])
def test_quantization_and_kv_cache_dtype_at_admission(cluster: Cluster, name: str, spec: dict, refusal) -> None:
    body = {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"source": "pvc://models/quantized"}, **spec},
    }
    result = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(body), check=False)
    if refusal is None:
        assert result.returncode == 0, result.stderr
        stored = json.loads(result.stdout)["spec"]
        assert {key: stored.get(key) for key in spec} == spec
        if "kvCacheDtype" not in spec:
            assert "kvCacheDtype" not in stored  # no default written into the resource: unset is the engine's auto
    else:
        assert result.returncode != 0 and "is invalid" in result.stderr and refusal in result.stderr, result.stderr
    assert cluster.get("modeldeployment", name, NS) is None
