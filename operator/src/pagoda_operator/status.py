"""The ModelDeployment status, computed from what is observed: the spec's validity, the Deployment, its pods.

Conditions: ``Ready`` (every wanted replica serves), ``Progressing`` (a rollout or scale-up is under way) and
``Degraded`` (something needs a human: InvalidSpec; the start-up reason an engine or model download reported in its
termination message, such as ModelNotFound, Unauthorized or OutOfMemory; ModelLoadFailed for any other crash loop;
a container the kubelet cannot start, with the kubelet's own waiting reason and message: ErrImagePull,
ImagePullBackOff, InvalidImageName, ErrImageNeverPull, CreateContainerConfigError (a missing Secret or ConfigMap),
CreateContainerError, RunContainerError; Unschedulable, with the scheduler's message; ProgressDeadlineExceeded when
the Deployment controller gave up waiting for the rollout). With LoRA on, ``LoraAdaptersReady`` too (see
``lora_status``); after a ``kubectl scale`` that autoscaling ignores, ``ScaleIgnored`` (see ``scale_status``).
``lastTransitionTime`` only changes when a condition's status changes.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from pagoda_operator.conditions import Condition, render_conditions
from pagoda_operator.lora_status import LoraStatus
from pagoda_operator.scale_status import ScaleStatus
from pagoda_operator.spec import InvalidSpec

# The kubelet's waiting reasons for a container it cannot start at all. They are reported as they are (the reason
# says what to fix), with the kubelet's message: for pulls it names the image, for the start failures the missing
# Secret, ConfigMap or key, or the runtime's error. The kubelet keeps retrying, but nearly always someone has to fix
# something (an image name, registry credentials, a Secret) first, so each is Degraded at once; the condition clears
# as soon as the pod's status no longer shows it.
_PULL_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
_START_FAILURES = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
_CRASH_FAILURES = frozenset({"CrashLoopBackOff"})
# What the engine's termination message starts with (pagoda.startup_failure): "REASON: cause".
STARTUP_REASONS = (
    "ModelNotFound",
    "Unauthorized",
    "OutOfMemory",
    "OutOfDiskSpace",
    "UnsupportedSpec",
    "ModelLoadFailed",
)
_REASON_LINE = re.compile(rf"^({'|'.join(STARTUP_REASONS)}): (.*)$", re.DOTALL)


def unschedulable(pods: Sequence[Mapping[str, Any]]) -> Optional[Condition]:
    """Degraded (Unschedulable) for a pod the scheduler could not place, with the scheduler's own message
    (e.g. "0/3 nodes are available: 3 Insufficient nvidia.com/gpu")."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                name = (pod.get("metadata") or {}).get("name", "?")
                why = cond.get("message") or cond.get("reason") or "no node fits it"
                return Condition("Degraded", True, "Unschedulable", f"pod {name} cannot be scheduled: {why}")
    return None


def stuck_rollout(deployment: Mapping[str, Any]) -> Optional[Condition]:
    """Degraded (ProgressDeadlineExceeded) once the Deployment controller stopped waiting for the rollout."""
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            message = cond.get("message") or "the rollout did not finish within its progress deadline"
            return Condition("Degraded", True, "ProgressDeadlineExceeded", message)
    return None


def pod_failure(pods: Sequence[Mapping[str, Any]]) -> Optional[Condition]:
    """A Degraded condition when a pod's container cannot be started (its image cannot be pulled, a Secret or
    ConfigMap it refers to is missing), or its model download or engine keeps failing.

    The engine and ``pagoda download`` end a failed start with a termination message ``REASON: cause`` (reasons in
    ``STARTUP_REASONS``), which becomes the condition's reason; the kubelet's ``OOMKilled`` becomes OutOfMemory; any
    other crash loop is ModelLoadFailed with whatever message the container left (its last log lines).
    """
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        status = pod.get("status") or {}
        containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        for container in containers:
            condition = _container_failure(name, container)
            if condition is not None:
                return condition
    return None


def _container_failure(pod: str, container: Mapping[str, Any]) -> Optional[Condition]:
    """Degraded for one container status that shows a failure, else None."""
    state = container.get("state") or {}
    waiting = state.get("waiting") or {}
    where = f"pod {pod}, container {container.get('name', '?')}"
    reason = waiting.get("reason")
    if reason in _PULL_FAILURES:
        why = waiting.get("message") or reason
        return Condition("Degraded", True, reason, f"{where}: cannot pull image {container.get('image', '?')}: {why}")
    if reason in _START_FAILURES:
        why = waiting.get("message") or reason
        return Condition("Degraded", True, reason, f"{where}: cannot start the container: {why}")
    if "running" in state:
        return None  # started again (maybe recovering); an earlier failure in lastState is history now
    terminated = state.get("terminated") or (container.get("lastState") or {}).get("terminated") or {}
    crash_looping = reason in _CRASH_FAILURES
    if not crash_looping and (not terminated or terminated.get("exitCode") == 0):
        return None
    match = _REASON_LINE.match(terminated.get("message") or "")
    if match:
        return Condition("Degraded", True, match.group(1), f"{where}: {match.group(2).strip()}")
    if terminated.get("reason") == "OOMKilled":
        return Condition("Degraded", True, "OutOfMemory", f"{where}: killed for exceeding its memory limit (OOMKilled)")
    if crash_looping:
        last = " ".join((terminated.get("message") or "").split())[-500:]
        message = f"{where}: exits while loading or serving the model (CrashLoopBackOff) {last}"
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
    # The most specific cause first: a container's own failure, then a pod nobody can place, then the
    # Deployment's deadline (which any of the others may also have caused).
    failure = pod_failure(pods) or unschedulable(pods) or stuck_rollout(deployment)
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
    elif failure is not None and failure.reason == "ProgressDeadlineExceeded":
        progressing = Condition("Progressing", False, "ProgressDeadlineExceeded", failure.message)
    else:
        progressing = Condition(
            "Progressing", True, "RollingOut", f"{updated}/{wanted} replicas updated, {ready} ready"
        )
    return [ready_condition, progressing, degraded]


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
    served_model_name: Optional[str] = None,
    lora: Optional[LoraStatus] = None,
    scale: Optional[ScaleStatus] = None,
    extra: Sequence[Condition] = (),
) -> dict[str, Any]:
    """The full ``.status`` to patch onto the ModelDeployment (``servedModelName``: the name clients send, also
    when the spec leaves it to default; null while the spec is invalid; ``loraAdapters`` null without LoRA, which
    removes a stale list; ``ignoredScale`` null unless a scale is being ignored; ``extra``: more conditions, such as
    the reconciler's RoutingAvailable and KedaAvailable)."""
    observed = (deployment or {}).get("status") or {}
    conditions = compute_conditions(error, deployment, pods) + ([lora.condition] if lora else [])
    if scale is not None and scale.condition is not None:
        conditions.append(scale.condition)
    conditions += extra
    status: dict[str, Any] = {
        "replicas": int(observed.get("replicas") or 0),
        "readyReplicas": int(observed.get("readyReplicas") or 0),
        "selector": selector,
        "endpoint": endpoint,
        "servedModelName": served_model_name,
        "loraAdapters": lora.adapters if lora else None,
        "ignoredScale": scale.ignored if scale else None,
        "conditions": render_conditions(conditions, previous.get("conditions") or [], generation, now),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def status_changes(previous: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``status`` that differ from ``previous`` (the live status): what a merge patch must write.
    Empty when nothing changed, so a quiet pass writes nothing."""
    return {key: value for key, value in status.items() if previous.get(key) != value}
