"""Status conditions from observations, and the reconciler's drift check."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from pagoda_operator.reconcile import comparable, owns_replicas
from pagoda_operator.spec import InvalidSpec
from pagoda_operator.status import compute_conditions, compute_status

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def deployment(
    wanted: int, ready: int, updated: int | None = None, generation: int = 2, seen: int = 2
) -> dict[str, Any]:
    status = {"replicas": wanted, "readyReplicas": ready, "updatedReplicas": wanted if updated is None else updated}
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": wanted},
        "status": {**status, "observedGeneration": seen},
    }


def pod(state: dict[str, Any]) -> dict[str, Any]:
    container = {"name": "engine", "image": "engine:1", "state": state}
    return {"metadata": {"name": "p-1"}, "status": {"containerStatuses": [container]}}


def summary(conditions: list[Any]) -> dict[str, tuple[bool, str]]:
    return {c.type: (c.status, c.reason) for c in conditions}


def stuck(observed: dict[str, Any]) -> dict[str, Any]:
    condition = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "m-5d" has timed out progressing.',
    }
    return {**observed, "status": {**observed["status"], "conditions": [condition]}}


def unplaced(message: str) -> dict[str, Any]:
    scheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    return {"metadata": {"name": "p-2"}, "status": {"phase": "Pending", "conditions": [scheduled]}}


def test_a_stuck_rollout_is_degraded_not_progressing() -> None:
    conditions = {c.type: c for c in compute_conditions(None, stuck(deployment(1, 0)), [])}
    assert (conditions["Degraded"].status, conditions["Degraded"].reason) == (True, "ProgressDeadlineExceeded")
    assert "timed out progressing" in conditions["Degraded"].message
    assert (conditions["Progressing"].status, conditions["Progressing"].reason) == (False, "ProgressDeadlineExceeded")
    assert conditions["Ready"].reason == "ProgressDeadlineExceeded"


def test_an_unschedulable_pod_says_what_the_scheduler_said() -> None:
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    conditions = {c.type: c for c in compute_conditions(None, deployment(1, 0), [unplaced(why)])}
    assert (conditions["Degraded"].status, conditions["Degraded"].reason) == (True, "Unschedulable")
    assert conditions["Degraded"].message == f"pod p-2 cannot be scheduled: {why}"
    assert conditions["Progressing"].status  # the scheduler may still place it: not given up
    # The pod's own failure is more specific than the Deployment's deadline.
    crashed = pod({"waiting": {"reason": "ImagePullBackOff", "message": "not found"}})
    both = {c.type: c for c in compute_conditions(None, stuck(deployment(1, 0)), [crashed])}
    assert both["Degraded"].reason == "ImagePullBackOff"


def expect(ready: tuple[bool, str], progressing: tuple[bool, str], degraded: tuple[bool, str]) -> dict[str, Any]:
    """The (status, reason) of Ready, Progressing and Degraded."""
    return {"Ready": ready, "Progressing": progressing, "Degraded": degraded}


NOT_READY, ROLLING_OUT, COMPLETE = (False, "ReplicasNotReady"), (True, "RollingOut"), (False, "RolloutComplete")
AS_EXPECTED = (False, "AsExpected")
INVALID = (False, "InvalidSpec")


@pytest.mark.parametrize(
    ("error", "observed", "pods", "expected"),
    [
        (InvalidSpec("spec.gpus", "x"), None, [], expect(INVALID, INVALID, (True, "InvalidSpec"))),
        (None, None, [], expect((False, "Pending"), (True, "Creating"), AS_EXPECTED)),
        (None, deployment(2, 1), [], expect(NOT_READY, ROLLING_OUT, AS_EXPECTED)),
        (None, deployment(2, 2), [], expect((True, "AllReplicasReady"), COMPLETE, AS_EXPECTED)),
        # the Deployment controller has not seen the new template yet
        (None, deployment(2, 2, seen=1), [], expect(NOT_READY, ROLLING_OUT, AS_EXPECTED)),
        (None, deployment(0, 0), [], expect((False, "ScaledToZero"), COMPLETE, AS_EXPECTED)),
        (
            None,
            deployment(1, 0),
            [pod({"waiting": {"reason": "ImagePullBackOff", "message": "not found"}})],
            expect((False, "ImagePullBackOff"), ROLLING_OUT, (True, "ImagePullBackOff")),
        ),
        (
            None,
            deployment(1, 0),
            [pod({"waiting": {"reason": "CrashLoopBackOff"}})],
            expect((False, "ModelLoadFailed"), ROLLING_OUT, (True, "ModelLoadFailed")),
        ),
    ],
)
def test_conditions(error: Any, observed: Any, pods: list[Any], expected: dict[str, tuple[bool, str]]) -> None:
    assert summary(compute_conditions(error, observed, pods)) == expected


def test_invalid_spec_message_names_the_field() -> None:
    (_, _, degraded) = compute_conditions(InvalidSpec("spec.loraAdapters[1].name", "used twice"), None, [])
    assert degraded.message == "invalid field spec.loraAdapters[1].name: used twice"


def test_transition_time_changes_only_when_the_status_changes() -> None:
    common = {"error": None, "pods": [], "generation": 2, "selector": "a=b", "endpoint": "http://x"}
    first = compute_status(deployment=deployment(1, 0), previous={}, now=T0, **common)
    same = compute_status(deployment=deployment(1, 0), previous=first, now=T1, **common)
    ready = compute_status(deployment=deployment(1, 1), previous=same, now=T1, **common)
    times = [{c["type"]: c["lastTransitionTime"] for c in s["conditions"]} for s in (first, same, ready)]
    assert (
        times[0]
        == times[1]
        == {"Ready": "2026-01-01T00:00:00Z", "Progressing": "2026-01-01T00:00:00Z", "Degraded": "2026-01-01T00:00:00Z"}
    )
    assert times[2] == {
        "Ready": "2026-01-01T00:05:00Z",
        "Progressing": "2026-01-01T00:05:00Z",
        "Degraded": "2026-01-01T00:00:00Z",
    }
    assert ready["observedGeneration"] == 2 and ready["readyReplicas"] == 1 and ready["selector"] == "a=b"


def test_only_a_real_change_counts_as_one() -> None:
    live = {
        "metadata": {"name": "m", "resourceVersion": "7", "generation": 3, "managedFields": [{"manager": "x"}]},
        "spec": {"replicas": 2},
        "status": {"readyReplicas": 1},
    }
    dry_run = {
        "metadata": {"name": "m", "resourceVersion": "8", "generation": 4, "managedFields": []},
        "spec": {"replicas": 2},
        "status": {},
    }
    assert comparable(live) == comparable(dry_run)
    assert comparable(live) != comparable({**dry_run, "spec": {"replicas": 3}})


def test_replica_ownership_is_read_from_managed_fields() -> None:
    deployment = {
        "metadata": {
            "managedFields": [
                {"manager": "pagoda-operator", "operation": "Apply", "fieldsV1": {"f:spec": {"f:template": {}}}},
                {"manager": "pagoda-autoscaler", "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}},
            ]
        }
    }
    assert owns_replicas(deployment, "pagoda-autoscaler")
    assert not owns_replicas(deployment, "pagoda-operator")


@pytest.mark.parametrize(
    ("reason", "kubelet_says"),
    [
        ("ErrImagePull", 'rpc error: code = NotFound desc = failed to pull and unpack image "engine:1": not found'),
        ("ImagePullBackOff", 'Back-off pulling image "engine:1"'),
        ("InvalidImageName", 'Failed to apply default image tag "engine:1": couldn\'t parse image reference'),
        ("ErrImageNeverPull", 'Container image "engine:1" is not present with pull policy of Never'),
    ],
)
def test_an_image_that_cannot_be_pulled_is_degraded_with_the_kubelets_reason(reason: str, kubelet_says: str) -> None:
    unpulled = pod({"waiting": {"reason": reason, "message": kubelet_says}})
    conditions = {c.type: c for c in compute_conditions(None, deployment(1, 0), [unpulled])}
    assert (conditions["Degraded"].status, conditions["Degraded"].reason) == (True, reason)
    assert conditions["Degraded"].message == f"pod p-1, container engine: cannot pull image engine:1: {kubelet_says}"
    assert conditions["Ready"].reason == reason


def test_a_missing_secret_is_degraded_with_the_kubelets_message() -> None:
    missing = pod({"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'}})
    (_, _, degraded) = compute_conditions(None, deployment(1, 0), [missing])
    assert (degraded.status, degraded.reason) == (True, "CreateContainerConfigError")
    assert degraded.message == 'pod p-1, container engine: cannot start the container: secret "hf-token" not found'


def test_the_download_init_container_failing_to_pull_is_degraded_too() -> None:
    waiting = {"waiting": {"reason": "ErrImagePull", "message": "unauthorized"}}
    init = {"name": "download", "image": "registry.example/engine:2", "state": waiting}
    pending = {"metadata": {"name": "p-3"}, "status": {"initContainerStatuses": [init]}}
    (_, _, degraded) = compute_conditions(None, deployment(1, 0), [pending])
    assert degraded.reason == "ErrImagePull"
    assert degraded.message == "pod p-3, container download: cannot pull image registry.example/engine:2: unauthorized"


@pytest.mark.parametrize("reason", ["ContainerCreating", "PodInitializing"])
def test_a_container_on_its_way_up_is_not_degraded(reason: str) -> None:
    (_, _, degraded) = compute_conditions(None, deployment(1, 0), [pod({"waiting": {"reason": reason}})])
    assert (degraded.status, degraded.reason) == (False, "AsExpected")
