"""``kubectl scale`` while autoscaling is on: the ScaleIgnored condition, ``status.ignoredScale`` and the warning.

Each case runs passes the way the operator does: the status one pass writes is the ``previous`` of the next.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import pytest

from pagoda_operator.scale_status import ScaleStatus, ignored_scale_from, scale_status
from pagoda_operator.spec import parse_spec
from pagoda_operator.status import compute_status

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
BUILTIN = {"enabled": True, "mode": "builtin", "minReplicas": 1, "maxReplicas": 4}


def spec(replicas: int, autoscaling: Optional[dict[str, Any]] = None) -> Any:
    fields: dict[str, Any] = {"replicas": replicas, "autoscaling": autoscaling or {"enabled": False}}
    return parse_spec({"metadata": {"name": "m", "namespace": "ns"}, "spec": fields})


def written(scale: ScaleStatus, previous: dict[str, Any], now: datetime.datetime = T0) -> dict[str, Any]:
    """The status a pass writes with this ignored-scale status."""
    common = {"error": None, "deployment": None, "pods": [], "generation": 1, "selector": "a=b", "endpoint": None}
    return compute_status(previous=previous, now=now, scale=scale, **common)


def condition(status: dict[str, Any]) -> Optional[dict[str, Any]]:
    return next((c for c in status["conditions"] if c["type"] == "ScaleIgnored"), None)


def test_a_scale_while_autoscaling_is_on_is_ignored_with_a_warning_naming_the_autoscaler() -> None:
    scale = scale_status(spec(5, BUILTIN), "m", {}, scaled_from=1)
    assert scale.condition is not None
    assert (scale.condition.status, scale.condition.reason) == (True, "AutoscalingEnabled")
    assert scale.condition.message == (
        "spec.replicas 5 is ignored: autoscaling is on and the operator's built-in autoscaler sets the replica "
        "count, between minReplicas 1 and maxReplicas 4; change spec.autoscaling to scale, turn autoscaling off to "
        "run spec.replicas, or set spec.replicas back to 1 to clear this"
    )
    assert scale.warning == scale.condition.message
    assert written(scale, {})["ignoredScale"] == {"replicas": 5, "previousReplicas": 1}


def test_with_an_hpa_the_message_names_the_hpa() -> None:
    hpa = {**BUILTIN, "mode": "hpa", "minReplicas": 2, "maxReplicas": 6}
    scale = scale_status(spec(9, hpa), "m", {}, scaled_from=2)
    assert scale.warning is not None
    assert "HorizontalPodAutoscaler m sets the replica count, between minReplicas 2 and maxReplicas 6" in scale.warning


def test_later_passes_keep_the_condition_without_warning_again() -> None:
    first = written(scale_status(spec(5, BUILTIN), "m", {}, scaled_from=1), {})
    later = scale_status(spec(5, BUILTIN), "m", first)  # the timer, the Deployment watch, a restarted operator
    assert later.warning is None
    again = written(later, first, now=T0 + datetime.timedelta(minutes=1))
    assert condition(again) == condition(first) and again["ignoredScale"] == first["ignoredScale"]


def test_each_further_scale_warns_again_and_remembers_the_first_value() -> None:
    first = written(scale_status(spec(5, BUILTIN), "m", {}, scaled_from=1), {})
    scale = scale_status(spec(7, BUILTIN), "m", first, scaled_from=5)
    assert scale.warning is not None and "spec.replicas 7 is ignored" in scale.warning
    assert scale.ignored == {"replicas": 7, "previousReplicas": 1}


@pytest.mark.parametrize(
    ("after", "reason"),
    [
        (spec(1, BUILTIN), "ReplicasRestored"),  # scaled back: the request is withdrawn
        (spec(5), "AutoscalingDisabled"),  # spec.replicas drives the Deployment again (it scales to 5 now)
    ],
)
def test_the_condition_turns_false_when_the_request_is_withdrawn_or_autoscaling_goes_off(
    after: Any, reason: str
) -> None:
    ignored = written(scale_status(spec(5, BUILTIN), "m", {}, scaled_from=1), {})
    scale = scale_status(after, "m", ignored, scaled_from=5 if after.autoscaling.enabled else None)
    assert scale.warning is None and scale.ignored is None
    cleared = written(scale, ignored, now=T0 + datetime.timedelta(minutes=1))
    found = condition(cleared)
    assert found is not None and (found["status"], found["reason"]) == ("False", reason)
    assert found["lastTransitionTime"] == "2026-01-01T00:01:00Z" and cleared["ignoredScale"] is None
    # It stays False, with its transition time, in the passes after that.
    later = written(scale_status(after, "m", cleared), cleared, now=T0 + datetime.timedelta(minutes=2))
    assert condition(later) == found


def test_a_resource_that_never_had_a_scale_ignored_has_no_such_condition() -> None:
    for current in (spec(1, BUILTIN), spec(3)):
        scale = scale_status(current, "m", {})
        assert scale == ScaleStatus(None, None, None)
        assert condition(written(scale, {})) is None


def test_an_invalid_spec_keeps_what_the_status_said() -> None:
    ignored = written(scale_status(spec(5, BUILTIN), "m", {}, scaled_from=1), {})
    kept = scale_status(None, "m", ignored)
    assert kept.warning is None and kept.ignored == ignored["ignoredScale"]
    assert condition(written(kept, ignored)) == condition(ignored)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ({"replicas": 1, "autoscaling": BUILTIN}, {"replicas": 3, "autoscaling": BUILTIN}, 1),
        ({"replicas": 3, "autoscaling": BUILTIN}, {"replicas": 3, "autoscaling": BUILTIN}, None),  # another field
        ({"replicas": 3}, {"replicas": 1, "autoscaling": BUILTIN}, None),  # turned on in the same edit
        ({"replicas": 1, "autoscaling": BUILTIN}, {"replicas": 3, "autoscaling": {"enabled": False}}, None),
        ({"replicas": 1}, {"replicas": 3}, None),  # autoscaling off: spec.replicas is simply applied
        (None, {"replicas": 3, "autoscaling": BUILTIN}, None),  # a creation has no old spec
        ({"spec": {"replicas": 1}}, {"spec": {"replicas": 3}}, None),  # whole bodies (resume) are not specs
    ],
)
def test_which_spec_changes_are_ignored_scale_requests(old: Any, new: Any, expected: Optional[int]) -> None:
    assert ignored_scale_from(old, new) == expected
