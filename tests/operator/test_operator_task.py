"""spec.task: the CRD's enum and CEL rule, the operator's parsing (frozen spec), the engine flag the builder renders,
and the capability contract (an engine whose contract has no pooling tasks is refused before a pod starts)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from operator_helpers import crd_openapi_schema, crd_validator, pod_spec, spec_of

from pagoda_operator.builders import engine_args
from pagoda_operator.capabilities import check_capabilities, engine_capabilities
from pagoda_operator.spec import TASKS, InvalidSpec


def _body(**spec) -> dict:
    return {"apiVersion": "pagoda.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}, "spec": spec}


def test_the_crd_takes_the_engines_tasks_and_nothing_else() -> None:
    schema = crd_openapi_schema()["properties"]["spec"]["properties"]["task"]
    assert tuple(schema["enum"]) == TASKS == tuple(engine_capabilities()["tasks"])
    assert schema["default"] == "generate"
    validator = crd_validator()
    for task in TASKS:
        assert list(validator.iter_errors(_body(task=task))) == []
    assert [e.path[-1] for e in validator.iter_errors(_body(task="chat"))] == ["task"]
    rules = [r["rule"] for r in crd_openapi_schema()["properties"]["spec"]["x-kubernetes-validations"]]
    assert "!has(self.task) || self.task == 'generate' || !has(self.loraAdapters)" in rules


@pytest.mark.parametrize("task", TASKS)
def test_the_builder_renders_the_task_as_the_engines_flag(task: str) -> None:
    spec = spec_of(task=task, model={"source": "BAAI/bge-small-en-v1.5"})
    assert spec.task == task
    args = engine_args(spec)
    if task == "generate":
        assert "--task" not in args  # the engine's default: no flag
    else:
        assert args[args.index("--task") + 1] == task
    container = pod_spec(task=task)["containers"][0]  # the Deployment validates strictly
    assert ("--task" in container["args"]) == (task != "generate")


def test_the_spec_is_frozen_and_defaults_to_generate() -> None:
    spec = spec_of()
    assert spec.task == "generate"
    with pytest.raises(AttributeError):
        spec.task = "embed"  # type: ignore[misc]


def test_bad_tasks_and_pooling_with_adapters_are_invalid_specs() -> None:
    with pytest.raises(InvalidSpec) as bad:
        spec_of(task="chat")
    assert bad.value.field == "spec.task"
    with pytest.raises(InvalidSpec) as lora:
        spec_of(task="embed", loraAdapters=[])
    assert lora.value.field == "spec.task" and "generate" in lora.value.message


def test_an_engine_without_pooling_in_its_contract_refuses_embed() -> None:
    check_capabilities(spec_of(task="embed"))  # this engine's contract lists it
    old = {k: v for k, v in engine_capabilities().items() if k != "tasks"}
    check_capabilities(spec_of(task="generate"), old)
    with pytest.raises(InvalidSpec) as refused:
        check_capabilities(spec_of(task="score"), old)
    assert refused.value.field == "spec.task"


def test_the_rendered_flag_is_one_the_engine_parses() -> None:
    args = engine_args(spec_of(task="score"))
    index = args.index("--task")
    code = (
        "import sys; from pagoda.cli import build_parser; "
        "ns = build_parser().parse_args(['serve', *sys.argv[1:]]); print(ns.task)"
    )
    result = subprocess.run([sys.executable, "-c", code, *args[index : index + 2]], capture_output=True, text=True)
    assert result.stdout.strip() == "score", result.stderr
