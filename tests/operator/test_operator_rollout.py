"""Rollouts without downtime, from the spec to the manifests: rollout bounds, drain time, disruption budget."""

from __future__ import annotations

from typing import Any, Optional

import pytest
from operator_helpers import OWNER, spec_of

from pagoda_operator.builders import build_deployment, build_pdb, engine_args
from pagoda_operator.constants import PRESTOP_SLEEP_SECONDS
from pagoda_operator.spec import InvalidSpec


def rolling_update(**spec: Any) -> dict[str, Any]:
    strategy = build_deployment(spec_of(**spec), OWNER)["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    return strategy["rollingUpdate"]


@pytest.mark.parametrize("gpus", [0, 1])
def test_by_default_a_new_pod_is_ready_before_an_old_one_stops_on_cpu_and_gpu(gpus: int) -> None:
    assert rolling_update(gpus=gpus) == {"maxSurge": 1, "maxUnavailable": 0}


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        ({"maxSurge": 0, "maxUnavailable": 1}, {"maxSurge": 0, "maxUnavailable": 1}),  # no spare GPU
        ({"maxSurge": "25%", "maxUnavailable": "0%"}, {"maxSurge": "25%", "maxUnavailable": "0%"}),
        ({"maxUnavailable": 2}, {"maxSurge": 1, "maxUnavailable": 2}),  # the other bound keeps its default
    ],
)
def test_rollout_bounds_become_the_deployments_rolling_update(rollout: dict[str, Any], expected: dict) -> None:
    assert rolling_update(gpus=1, rollout=rollout) == expected


@pytest.mark.parametrize(
    ("rollout", "field"),
    [
        ({"maxSurge": 0}, "spec.rollout"),  # maxUnavailable defaults to 0: a rollout that could never progress
        ({"maxSurge": "0%", "maxUnavailable": 0}, "spec.rollout"),
        ({"maxUnavailable": "101%"}, "spec.rollout.maxUnavailable"),
        ({"maxSurge": -1}, "spec.rollout.maxSurge"),
        ({"maxSurge": "one"}, "spec.rollout.maxSurge"),
        ({"maxSurge": True}, "spec.rollout.maxSurge"),
    ],
)
def test_rollouts_that_cannot_progress_or_do_not_parse_are_refused(rollout: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpec) as error:
        spec_of(rollout=rollout)
    assert error.value.field == field


def shutdown_timeout(args: list[str]) -> int:
    return int(args[args.index("--shutdown-timeout") + 1])


@pytest.mark.parametrize(
    ("spec", "drain"),
    [
        ({}, 30),
        ({"drainSeconds": 90}, 90),
        ({"drainSeconds": 0}, 0),
        ({"engine": {"shutdownTimeoutSeconds": 60}}, 60),  # the older field still works alone ...
        ({"drainSeconds": 90, "engine": {"shutdownTimeoutSeconds": 60}}, 90),  # ... and gives way to drainSeconds
    ],
)
def test_drain_seconds_set_the_engines_shutdown_timeout_and_the_grace_period(spec: dict, drain: int) -> None:
    assert shutdown_timeout(engine_args(spec_of(**spec))) == drain
    pod = build_deployment(spec_of(**spec), OWNER)["spec"]["template"]["spec"]
    # preStop first (endpoints stop sending traffic), then the drain, then a margin before SIGKILL
    assert pod["terminationGracePeriodSeconds"] == PRESTOP_SLEEP_SECONDS + drain + 10


@pytest.mark.parametrize(
    ("spec", "budget"),
    [
        ({}, None),  # one replica: a budget could only stall node drains
        ({"replicas": 0}, None),
        ({"replicas": 2}, 1),
        ({"replicas": 5, "gpus": 1}, 1),
        ({"replicas": 5, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8}}, None),
        ({"replicas": 1, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8}}, 1),
    ],
)
def test_a_disruption_budget_lets_one_pod_go_at_a_time_from_two_replicas_on(spec: dict, budget: Optional[int]) -> None:
    pdb = build_pdb(spec_of(**spec), OWNER)
    if budget is None:
        assert pdb is None
        return
    assert (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    deployment = build_deployment(spec_of(**spec), OWNER)
    assert pdb["spec"] == {"maxUnavailable": budget, "selector": deployment["spec"]["selector"]}
    assert pdb["metadata"] == deployment["metadata"]  # same name, labels and controller owner reference
