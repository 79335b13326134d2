"""ModelDeploymentSpec parsing: defaults, sources, and the rules the CRD schema cannot express."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda_operator.spec import InvalidSpec, ModelSource, parse_source, parse_spec


def body(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": spec}


def test_empty_spec_serves_the_builtin_model_on_the_cpu_under_the_resource_name() -> None:
    spec = parse_spec(body())
    assert spec.model.kind == "builtin"
    assert spec.served_model_name == "m"
    assert spec.gpus == 0 and spec.replicas == 1 and not spec.autoscaling.enabled
    assert spec.quantization is None and spec.kv_cache_dtype is None  # the engine's defaults: no flags
    assert spec.image == "ghcr.io/pagoda-dev/pagoda-engine:0.1.0"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Qwen/Qwen3-0.6B", ModelSource("hf", "Qwen/Qwen3-0.6B")),
        ("hf://Qwen/Qwen3-0.6B", ModelSource("hf", "Qwen/Qwen3-0.6B")),
        ("gpt2", ModelSource("hf", "gpt2")),
        ("pvc://models/llama/3-8b", ModelSource("pvc", "llama/3-8b", claim="models")),
        ("/opt/models/tiny", ModelSource("path", "/opt/models/tiny")),
        (None, ModelSource("builtin", "")),
    ],
)
def test_sources(text: str | None, expected: ModelSource) -> None:
    assert parse_source(text, "spec.model.source") == expected


@pytest.mark.parametrize(
    "text", ["pvc://", "pvc://models", "pvc://models/", "pvc://Bad_Claim/x", "pvc://m/../etc", "a b"]
)
def test_malformed_sources_name_the_field(text: str) -> None:
    with pytest.raises(InvalidSpec) as error:
        parse_spec(body(model={"source": text}))
    assert error.value.field == "spec.model.source"


@pytest.mark.parametrize(
    "source", ["s3://models/../../../../tmp/pwned", "s3://models/a/../b", "s3://models/./a", "s3://models/a/.."]
)
@pytest.mark.parametrize("where", ["model", "adapter"])
def test_s3_sources_with_dot_segments_are_refused(source: str, where: str) -> None:
    """The engine names its download folder after the URL: '..' would lead it out of the model cache."""
    spec = {"model": {"source": source}} if where == "model" else {"loraAdapters": [{"name": "a", "source": source}]}
    field = "spec.model.source" if where == "model" else "spec.loraAdapters[0].source"
    with pytest.raises(InvalidSpec, match="may not hold '.' or '..' path segments") as error:
        parse_spec(body(**spec))
    assert error.value.field == field
    assert parse_source("s3://models/a..b/c.d", field) == ModelSource("s3", "s3://models/a..b/c.d")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
        ({"gpus": 1, "quantization": "int8"}, "spec.quantization"),
        ({"gpus": 4, "quantization": "int8"}, "spec.quantization"),
        (
            {"gpus": 1, "loraAdapters": [{"name": "a", "source": "x/a"}, {"name": "a", "source": "x/b"}]},
            "spec.loraAdapters[1].name",
        ),
        ({"gpus": 1, "loraAdapters": [{"name": "a", "source": "pvc://nopath"}]}, "spec.loraAdapters[0].source"),
        ({"maxLoras": 2}, "spec.maxLoras"),
        ({"modelCache": {"type": "pvc"}}, "spec.modelCache.claimName"),
    ],
)
def test_cross_field_rules_raise_invalid_spec_naming_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpec) as error:
        parse_spec(body(**spec))
    assert error.value.field == field
    assert str(error.value).startswith(field + ": ")


def test_min_above_max_is_fine_while_autoscaling_is_off() -> None:
    assert parse_spec(body(autoscaling={"enabled": False, "minReplicas": 3, "maxReplicas": 2})).replicas == 1


def test_max_replicas_defaults_to_min_replicas() -> None:
    assert parse_spec(body(autoscaling={"enabled": True, "minReplicas": 3})).autoscaling.max_replicas == 3


def test_spec_is_frozen() -> None:
    spec = parse_spec(body())
    with pytest.raises(AttributeError):
        spec.gpus = 2  # type: ignore[misc]


def test_pvc_claims_are_distinct_in_first_use_order() -> None:
    spec = parse_spec(
        body(
            gpus=1,
            model={"source": "pvc://models/base"},
            loraAdapters=[{"name": "a", "source": "pvc://adapters/a"}, {"name": "b", "source": "pvc://models/b"}],
        )
    )
    assert spec.pvc_claims() == ["models", "adapters"]
