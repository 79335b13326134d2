"""``quantization`` and ``kvCacheDtype``: what the operator passes to the engine, and what it refuses, naming the field.

Pure: ``parse_spec`` (the mirror of the CRD's CEL rules), ``check_capabilities`` against the operator's copy of the
engine's contract (or a changed copy, to show a rule comes from the contract) and the Deployment builder.
test_control_plane.py applies the same specs to a real API server.
"""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import OWNER, spec_of, validate_kubernetes

from pagoda_operator.builders import build_deployment, engine_args
from pagoda_operator.capabilities import check_capabilities, engine_capabilities
from pagoda_operator.spec import InvalidSpec

QUANTIZED_MODEL = {"source": "pvc://models/qwen3-quantized"}


def refused(contract: dict[str, Any] | None = None, **spec: Any) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        check_capabilities(spec_of(**spec), contract)
    return info.value


def with_device(device: str, **entry: Any) -> dict[str, Any]:
    """The operator's contract with ``entry`` changed in ``device``'s entry."""
    contract = engine_capabilities()
    return {**contract, "devices": {**contract["devices"], device: {**contract["devices"][device], **entry}}}


# ---- served ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantization", ["awq", "gptq", "fp8", "int8"])
def test_every_method_is_served_on_cpu_replicas(quantization: str) -> None:
    check_capabilities(spec_of(model=QUANTIZED_MODEL, gpus=0, quantization=quantization))


@pytest.mark.parametrize(("quantization", "gpus"), [("awq", 1), ("gptq", 1), ("fp8", 1), ("fp8", 2), ("fp8", 8)])
def test_awq_gptq_on_one_gpu_and_fp8_on_any_number_are_served(quantization: str, gpus: int) -> None:
    check_capabilities(spec_of(model=QUANTIZED_MODEL, gpus=gpus, quantization=quantization))


@pytest.mark.parametrize("gpus", [0, 1, 4])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_every_kv_cache_dtype_is_served_on_both_devices(kv_cache_dtype: str, gpus: int) -> None:
    spec = spec_of(model=QUANTIZED_MODEL, gpus=gpus, kvCacheDtype=kv_cache_dtype)
    assert spec.kv_cache_dtype == kv_cache_dtype
    check_capabilities(spec)


# ---- refused -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_int8_on_a_gpu_is_refused_when_the_spec_is_parsed(gpus: int) -> None:
    with pytest.raises(InvalidSpec) as info:  # the CRD's CEL rule, mirrored
        spec_of(gpus=gpus, quantization="int8")
    assert info.value.field == "spec.quantization" and f"spec.gpus is {gpus}" in info.value.message


@pytest.mark.parametrize("quantization", ["awq", "gptq"])
@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_awq_and_gptq_with_tensor_parallelism_are_refused_naming_the_method(quantization: str, gpus: int) -> None:
    error = refused(model=QUANTIZED_MODEL, gpus=gpus, quantization=quantization)
    assert error.field == "spec.quantization"
    assert f"{quantization} checkpoints with tensor parallelism (spec.gpus is {gpus})" in error.message
    assert "set gpus to 1" in error.message


def test_the_tensor_parallel_rule_is_the_contracts_not_a_list_in_the_operator() -> None:
    spec = {"model": QUANTIZED_MODEL, "gpus": 4, "quantization": "awq"}
    check_capabilities(spec_of(**spec), with_device("cuda", quantization_without_tensor_parallel=["gptq"]))
    assert refused(with_device("cuda", quantization_without_tensor_parallel=["awq"]), **spec).field == (
        "spec.quantization"
    )
    fp8 = {**spec, "quantization": "fp8"}
    check_capabilities(spec_of(**fp8))
    assert refused(with_device("cuda", quantization_without_tensor_parallel=["fp8"]), **fp8).field == (
        "spec.quantization"
    )


def test_a_method_the_contract_does_not_list_on_the_device_is_refused() -> None:
    contract = with_device("cpu", quantization=["int8"])
    error = refused(contract, model=QUANTIZED_MODEL, quantization="awq")
    assert error.field == "spec.quantization" and "awq is not served on cpu replicas by this engine (int8)" in str(
        error
    )
    check_capabilities(spec_of(model=QUANTIZED_MODEL, gpus=1, quantization="awq"), contract)  # cuda still has it


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_a_kv_cache_dtype_the_contract_does_not_list_is_refused_naming_the_field(kv_cache_dtype: str) -> None:
    contract = with_device("cuda", kv_cache_dtypes=["auto"])
    error = refused(contract, gpus=1, kvCacheDtype=kv_cache_dtype)
    assert error.field == "spec.kvCacheDtype"
    assert f"{kv_cache_dtype} is not served on cuda replicas by this engine (auto)" in error.message
    check_capabilities(spec_of(gpus=0, kvCacheDtype=kv_cache_dtype), contract)  # the cpu entry still lists it
    check_capabilities(spec_of(gpus=1, kvCacheDtype="auto"), contract)


def test_an_unknown_kv_cache_dtype_that_skipped_the_schema_is_refused() -> None:
    assert refused(kvCacheDtype="int8").field == "spec.kvCacheDtype"


def test_the_kv_cache_dtype_flag_in_extra_args_points_at_the_field() -> None:
    error = refused(engine={"extraArgs": ["--kv-cache-dtype", "fp8_e4m3"]})
    assert error.field == "spec.engine.extraArgs[0]" and "spec.kvCacheDtype" in error.message


# ---- the engine container ----------------------------------------------------------------------------------------


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == flag]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_is_one_flag_on_the_engine(kv_cache_dtype: str) -> None:
    spec = {"model": QUANTIZED_MODEL, "quantization": "gptq", "kvCacheDtype": kv_cache_dtype}
    deployment = build_deployment(spec_of(**spec), OWNER)
    validate_kubernetes(deployment)
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    assert flag_values(engine["args"], "--kv-cache-dtype") == [kv_cache_dtype]
    assert flag_values(engine["args"], "--quantization") == ["gptq"]


@pytest.mark.parametrize("spec", [{}, {"kvCacheDtype": "auto"}, {"quantization": "fp8", "kvCacheDtype": "auto"}])
def test_an_unset_or_auto_kv_cache_dtype_adds_no_flag(spec: dict[str, Any]) -> None:
    assert "--kv-cache-dtype" not in engine_args(spec_of(**spec))
