"""--task and vLLM's --runner pooling / --convert spellings of it, as `pagoda serve` parses and validates them."""

from __future__ import annotations

import pytest

from pagoda.cli import build_parser
from pagoda.cli_models import engine_args_from


def _task(*flags: str) -> str:
    args = engine_args_from(build_parser().parse_args(["serve", *flags]))
    args.validate()  # what `pagoda serve` does before it binds the port
    return args.task


@pytest.mark.parametrize(
    ("flags", "task"),
    [
        ((), "generate"),
        (("--task", "embed"), "embed"),
        (("--task", "score"), "score"),
        (("--runner", "pooling"), "embed"),  # --convert auto: the architecture may still make it score
        (("--runner", "pooling", "--convert", "embed"), "embed"),
        (("--runner", "pooling", "--convert", "classify"), "score"),
        (("--convert", "score"), "score"),
        (("--runner", "pooling", "--task", "score"), "score"),
        (("--runner", "generate"), "generate"),
    ],
)
def test_the_spellings_map_onto_the_task(flags: tuple[str, ...], task: str) -> None:
    assert _task(*flags) == task


@pytest.mark.parametrize(
    "flags",
    [
        ("--runner", "generate", "--task", "embed"),
        ("--runner", "generate", "--convert", "embed"),
        ("--task", "embed", "--convert", "classify"),
    ],
)
def test_contradicting_spellings_are_refused(flags: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="--runner|--convert"):
        _task(*flags)


def test_unknown_tasks_are_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--task", "chat"])


@pytest.mark.parametrize("engine_args", [{"task": "embed"}, {"task": "score"}, {"runner": "pooling"}])
def test_the_generation_engine_refuses_a_pooling_task_instead_of_generating(engine_args) -> None:
    from pagoda import LLM

    with pytest.raises(ValueError, match="pagoda serve"):
        LLM(**engine_args)
