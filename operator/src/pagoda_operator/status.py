"""The ModelDeployment status, computed from what is observed: the spec's validity, the Deployment, its pods.

Conditions: ``Ready`` (every wanted replica serves), ``Progressing`` (a rollout or scale-up is under way) and
``Degraded`` (something needs a human: InvalidSpec, ModelLoadFailed when the engine crash-loops, ImagePullBackOff).
``lastTransitionTime`` only changes when a condition's status changes.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from pagoda_operator.spec import InvalidSpec

_PULL_FAILURES = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName"})
_CRASH_FAILURES = frozenset({"CrashLoopBackOff"})


@dataclass(slots=True, frozen=True)
class Condition:
    """One status condition before timestamps are attached."""

    type: str
    status: bool
    reason: str
    message: str


def pod_failure(pods: Sequence[Mapping[str, Any]]) -> Optional[Condition]:
    """A Degraded condition when an engine container cannot pull its image or keeps crashing, else None."""
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in _PULL_FAILURES:
                message = (
                    f"pod {name}: cannot pull image {container.get('image', '')}: {waiting.get('message', reason)}"
                )
                return Condition("Degraded", True, "ImagePullBackOff", message)
            if reason in _CRASH_FAILURES:
                last = ((container.get("lastState") or {}).get("terminated") or {}).get("message", "")
                message = f"pod {name}: the engine exits while loading or serving the model (CrashLoopBackOff) {last}"
                return Condition("Degraded", True, "ModelLoadFailed", message.strip())
    return None


def compute_conditions(
    error: Optional[InvalidSpec],
    deployment: Optional[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
) -> list[Condition]:
    """Ready, Progressing and Degraded for what was observed."""
    if error is not None:
        message = f"invalid field {error.field}: {error.message}"
        return [
            Condition("Ready", False, "InvalidSpec", message),
            Condition("Progressing", False, "InvalidSpec", message),
            Condition("Degraded", True, "InvalidSpec", message),
        ]
    if deployment is None:
        waiting = "the Deployment does not exist yet"
        return [
            Condition("Ready", False, "Pending", waiting),
            Condition("Progressing", True, "Creating", waiting),
            Condition("Degraded", False, "AsExpected", ""),
        ]
    wanted = int((deployment.get("spec") or {}).get("replicas", 1))
    observed = deployment.get("status") or {}
    ready = int(observed.get("readyReplicas") or 0)
    updated = int(observed.get("updatedReplicas") or 0)
    total = int(observed.get("replicas") or 0)
    generation_seen = observed.get("observedGeneration", 0) >= (deployment.get("metadata") or {}).get("generation", 0)
    rolled_out = generation_seen and updated >= wanted and total <= wanted
    failure = pod_failure(pods)
    degraded = failure or Condition("Degraded", False, "AsExpected", "")
    if wanted == 0:
        ready_condition = Condition("Ready", False, "ScaledToZero", "no replicas are wanted")
    elif ready >= wanted and rolled_out:
        ready_condition = Condition("Ready", True, "AllReplicasReady", f"{ready}/{wanted} replicas are ready")
    else:
        reason = failure.reason if failure else "ReplicasNotReady"
        ready_condition = Condition("Ready", False, reason, f"{ready}/{wanted} replicas are ready")
    if rolled_out and ready >= wanted:
        progressing = Condition("Progressing", False, "RolloutComplete", "")
    else:
        progressing = Condition(
            "Progressing", True, "RollingOut", f"{updated}/{wanted} replicas updated, {ready} ready"
        )
    return [ready_condition, progressing, degraded]


def render_conditions(
    conditions: Sequence[Condition],
    previous: Sequence[Mapping[str, Any]],
    generation: Optional[int],
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Conditions as status dicts; a condition keeps its lastTransitionTime while its status does not change."""
    before = {c.get("type"): c for c in previous}
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    rendered: list[dict[str, Any]] = []
    for condition in conditions:
        status = "True" if condition.status else "False"
        old = before.get(condition.type) or {}
        item: dict[str, Any] = {
            "type": condition.type,
            "status": status,
            "reason": condition.reason,
            "message": condition.message,
            "lastTransitionTime": old.get("lastTransitionTime", stamp) if old.get("status") == status else stamp,
        }
        if generation is not None:
            item["observedGeneration"] = generation
        rendered.append(item)
    return rendered


def compute_status(
    *,
    error: Optional[InvalidSpec],
    deployment: Optional[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    previous: Mapping[str, Any],
    generation: Optional[int],
    selector: str,
    endpoint: Optional[str],
    now: datetime.datetime,
) -> dict[str, Any]:
    """The full ``.status`` to patch onto the ModelDeployment."""
    observed = (deployment or {}).get("status") or {}
    conditions = compute_conditions(error, deployment, pods)
    status: dict[str, Any] = {
        "replicas": int(observed.get("replicas") or 0),
        "readyReplicas": int(observed.get("readyReplicas") or 0),
        "selector": selector,
        "endpoint": endpoint,
        "conditions": render_conditions(conditions, previous.get("conditions") or [], generation, now),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status
