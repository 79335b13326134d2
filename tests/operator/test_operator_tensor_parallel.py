"""``gpus: N``: tensor parallelism N in the pod (flag, GPUs, /dev/shm, NCCL settings) and the specs it is refused for.

Pure: builders and ``check_capabilities`` against the operator's copy of the engine's contract, no cluster.
test_control_plane.py does the same against a real API server: the CRD's ``gpus`` maximum
(``bad-gpus-above-max.yaml``), the refusals, and a ``gpus: 2`` pod run here (two workers on the CPU).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from operator_helpers import crd_openapi_schema, crd_validator, pod_spec, spec_of

from pagoda_operator.builders.parallel import TENSOR_PARALLEL_ENV, default_shm_size
from pagoda_operator.capabilities import check_capabilities, engine_capabilities, tensor_parallel_problem
from pagoda_operator.spec import InvalidSpec

ADAPTERS = [{"name": "sql", "source": "org/sql-lora"}]


def env_items(**spec: Any) -> list[dict[str, Any]]:
    return pod_spec(**spec)["containers"][0]["env"]


def shm_limit(**spec: Any) -> str:
    (shm,) = [v for v in pod_spec(**spec)["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    return shm["emptyDir"]["sizeLimit"]


# ---- the pod -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_n_gpus_are_one_pod_with_tensor_parallelism_n(gpus: int) -> None:
    spec = pod_spec(model={"source": "org/model"}, gpus=gpus)
    (engine,) = spec["containers"]
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == str(gpus)
    assert engine["resources"] == {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}}
    assert {"name": "shm", "mountPath": "/dev/shm"} in engine["volumeMounts"]


@pytest.mark.parametrize(("gpus", "size"), [(0, "1Gi"), (1, "1Gi"), (2, "2Gi"), (4, "4Gi"), (8, "8Gi")])
def test_dev_shm_is_sized_for_the_workers_unless_the_spec_sizes_it(gpus: int, size: str) -> None:
    assert default_shm_size(gpus) == size
    assert shm_limit(model={"source": "org/model"}, gpus=gpus) == size
    for explicit in ("512Mi", "1Gi", "16Gi"):  # the user's value wins, also below the default
        assert shm_limit(model={"source": "org/model"}, gpus=gpus, shmSize=explicit) == explicit


def test_shm_size_is_left_unset_by_the_crd_so_the_operator_can_tell_it_was_not_given() -> None:
    # A CRD default would be written into every resource and look exactly like a value the user chose.
    assert "default" not in crd_openapi_schema()["properties"]["spec"]["properties"]["shmSize"]
    assert spec_of().shm_size is None and spec_of(shmSize="3Gi").shm_size == "3Gi"


@pytest.mark.parametrize("gpus", [2, 8])
def test_nccl_and_gloo_settings_come_with_two_gpus_or_more(gpus: int) -> None:
    env = {item["name"]: item.get("value") for item in env_items(model={"source": "org/model"}, gpus=gpus)}
    assert {name: env.get(name) for name in TENSOR_PARALLEL_ENV} == {
        "NCCL_DEBUG": "WARN",
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
    }


@pytest.mark.parametrize("gpus", [0, 1])
def test_no_collective_settings_without_tensor_parallelism(gpus: int) -> None:
    names = {item["name"] for item in env_items(gpus=gpus)}
    assert not names & set(TENSOR_PARALLEL_ENV)


def test_nothing_steers_nccls_choice_of_transport() -> None:
    # NVLink, PCIe peer-to-peer and shared memory are NCCL's own choice: turning one off would cost bandwidth.
    assert not [name for name in TENSOR_PARALLEL_ENV if name.startswith(("NCCL_P2P", "NCCL_SHM", "NCCL_NVLS"))]
    assert "NCCL_ALGO" not in TENSOR_PARALLEL_ENV and "NCCL_PROTO" not in TENSOR_PARALLEL_ENV


def test_the_users_env_wins_and_each_name_appears_once() -> None:
    user = [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}]
    items = env_items(model={"source": "org/model"}, gpus=4, engine={"env": user})
    names = [item["name"] for item in items]
    assert len(names) == len(set(names)), names
    env = {item["name"]: item.get("value") for item in items}
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "lo"


# ---- what the operator refuses -------------------------------------------------------------------------------------


def refused(contract: dict[str, Any] | None = None, **spec: Any) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        check_capabilities(spec_of(**spec), contract)
    return info.value


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_lora_with_tensor_parallelism_is_refused_naming_the_adapters(gpus: int) -> None:
    error = refused(model={"source": "org/model"}, gpus=gpus, loraAdapters=ADAPTERS)
    assert error.field == "spec.loraAdapters"
    assert "tensor parallelism" in error.message and f"gpus is {gpus}" in error.message
    assert "set gpus to 1, or remove loraAdapters" in error.message
    assert refused(model={"source": "org/model"}, gpus=2, loraAdapters=[]).field == "spec.loraAdapters"  # LoRA on


@pytest.mark.parametrize("gpus", [0, 1])
def test_lora_without_tensor_parallelism_passes(gpus: int) -> None:
    check_capabilities(spec_of(model={"source": "org/model"}, gpus=gpus, loraAdapters=ADAPTERS))


def test_lora_with_tensor_parallelism_passes_once_the_engine_serves_it() -> None:
    contract = engine_capabilities()
    serves = {**contract, "lora": {**contract["lora"], "tensor_parallel": True}}
    check_capabilities(spec_of(model={"source": "org/model"}, gpus=4, loraAdapters=ADAPTERS), serves)


def test_the_contract_describes_the_builtin_model_the_operator_checks() -> None:
    rule = engine_capabilities()["tensor_parallel"]
    assert rule["divides"] == ["num_attention_heads", "intermediate_size"]
    assert rule["builtin_model"] == {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 172}
    assert engine_capabilities()["lora"]["tensor_parallel"] is False


@pytest.mark.parametrize(
    ("gpus", "words"),
    [
        (3, "num_attention_heads 8 is not divisible by 3"),
        (5, "num_attention_heads 8 is not divisible by 5"),
        (8, "intermediate_size 172 is not divisible by 8"),
    ],
)
def test_the_builtin_model_is_refused_where_it_does_not_split(gpus: int, words: str) -> None:
    error = refused(gpus=gpus)
    assert error.field == "spec.gpus" and words in error.message, error
    assert f"tensor parallelism {gpus} cannot split the built-in model" in error.message


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
def test_the_builtin_model_passes_where_it_splits(gpus: int) -> None:
    check_capabilities(spec_of(gpus=gpus))


@pytest.mark.parametrize("gpus", [3, 6, 8])
def test_other_models_are_left_to_the_engine(gpus: int) -> None:
    # The operator does not know their sizes: the engine refuses one that does not split when it reads its config.
    for source in ("org/model", "s3://bucket/model", "pvc://models/m", "/models/m"):
        check_capabilities(spec_of(model={"source": source}, gpus=gpus))


def test_more_gpus_than_the_engine_serves_are_refused() -> None:
    error = refused(model={"source": "org/model"}, gpus=9)
    assert error.field == "spec.gpus" and "serves at most 8" in error.message


def test_the_crds_gpus_maximum_is_the_engines_tensor_parallel_maximum() -> None:
    maximum = crd_openapi_schema()["properties"]["spec"]["properties"]["gpus"]["maximum"]
    assert maximum == engine_capabilities()["devices"]["cuda"]["tensor_parallel_max"] == 8
    body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "x"}}
    assert not list(crd_validator().iter_errors({**body, "spec": {"gpus": 8}}))
    assert list(crd_validator().iter_errors({**body, "spec": {"gpus": 9}}))


# ---- the rule, as the engine applies it ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "kv_heads", "intermediate", "size", "ok"),
    [
        (32, 8, 14336, 8, True),  # Llama-3-8B-shaped
        (32, 8, 14336, 4, True),
        (64, 8, 28672, 8, True),  # Llama-3-70B-shaped
        (16, 8, 3072, 8, True),  # Qwen3-0.6B-shaped
        (28, 4, 18944, 8, False),  # 28 heads over 8
        (32, 2, 14336, 8, True),  # fewer KV heads than ranks: replicated
        (24, 3, 8192, 2, False),  # 3 KV heads over 2 ranks
        (24, 6, 8192, 4, False),  # 6 KV heads over 4 ranks: neither divides the other
        (32, 32, 11008, 8, True),
        (32, 32, 11000, 16, False),
    ],
)
def test_the_operators_rule_is_the_engines(heads: int, kv_heads: int, intermediate: int, size: int, ok: bool) -> None:
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate}
    problem = tensor_parallel_problem(sizes, engine_capabilities()["tensor_parallel"]["divides"], size)
    assert (problem is None) == ok, problem
    from pagoda.distributed.parallel import check_shardable  # the engine's own check (imports torch)

    config = SimpleNamespace(**sizes)
    if ok:
        check_shardable(config, size)
    else:
        with pytest.raises(ValueError):
            check_shardable(config, size)
