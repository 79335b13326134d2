"""A scale request that autoscaling ignores: the ``ScaleIgnored`` condition, ``status.ignoredScale`` and an Event.

While autoscaling is on, the autoscaler owns the Deployment's replicas and ``spec.replicas`` is not used. The scale
subresource (``kubectl scale md NAME --replicas=N``, or any tool that scales the resource) still writes
``spec.replicas``, and the API server accepts it, so without a word from the operator nothing would happen and
nobody would know why. The operator never writes the spec back (GitOps tools own it); it says so instead:

- A change of ``spec.replicas`` while autoscaling is on (before and after the change) posts a Warning Event
  ``ScaleIgnored`` and sets the condition ``ScaleIgnored`` True (reason ``AutoscalingEnabled``); both messages name
  the autoscaler and its ``minReplicas``/``maxReplicas``.
- ``status.ignoredScale`` holds ``replicas`` (what was asked) and ``previousReplicas`` (``spec.replicas`` before the
  first ignored change), so every later pass (the timer, the Deployment watch, an operator restart) keeps the
  condition without having seen the change itself.
- The condition turns False, and ``ignoredScale`` is removed, when autoscaling is turned off (reason
  ``AutoscalingDisabled``: ``spec.replicas`` drives the Deployment again, so the Deployment now scales to it) or
  when ``spec.replicas`` is set back to ``previousReplicas`` (reason ``ReplicasRestored``: the request was
  withdrawn). A False condition stays, so its ``lastTransitionTime`` tells when that happened; a resource that never
  had a scale ignored has no ``ScaleIgnored`` condition at all.

A ``spec.replicas`` change in the same edit that turns autoscaling on or off is not a scale request: turning it on
keeps the live replica count by design, turning it off applies ``spec.replicas``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from pagoda_operator.conditions import Condition, find_condition
from pagoda_operator.spec import Autoscaling, ModelDeploymentSpec

CONDITION = "ScaleIgnored"


@dataclass(slots=True, frozen=True)
class ScaleStatus:
    """What this pass says about ignored scale requests.

    ``condition``: the ``ScaleIgnored`` condition, None when the resource never had one; ``ignored``: the value of
    ``status.ignoredScale`` (None removes it); ``warning``: the message of a Warning Event to post, only for a scale
    request this pass saw being made."""

    condition: Optional[Condition]
    ignored: Optional[dict[str, int]]
    warning: Optional[str] = None


def ignored_scale_from(old_spec: Any, new_spec: Any) -> Optional[int]:
    """``spec.replicas`` before a change that autoscaling ignores (on before and after it), else None.

    Takes the raw specs kopf hands an update handler of field ``spec``; anything else (a creation's missing old
    value, whole bodies) is not such a change."""
    if not isinstance(old_spec, Mapping) or not isinstance(new_spec, Mapping):
        return None
    if not (_autoscaled(old_spec) and _autoscaled(new_spec)):
        return None
    before, after = old_spec.get("replicas"), new_spec.get("replicas")
    if not isinstance(before, int) or not isinstance(after, int) or before == after:
        return None
    return before


def _autoscaled(spec: Mapping[str, Any]) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def scale_status(
    spec: Optional[ModelDeploymentSpec], name: str, previous: Mapping[str, Any], scaled_from: Optional[int] = None
) -> ScaleStatus:
    """The ignored-scale status for ``spec`` (None while invalid: kept as it was), given the live status
    ``previous`` and, when this pass handles a change of ``spec.replicas`` made while autoscaling was on, the value
    before it (``scaled_from``, from ``ignored_scale_from``)."""
    record = previous.get("ignoredScale") or None
    before = find_condition(previous, CONDITION)
    if spec is None:
        return ScaleStatus(_as_condition(before), record)
    scaling = spec.autoscaling
    baseline = (record or {}).get("previousReplicas", scaled_from) if scaling.enabled else None
    if baseline is None or spec.replicas == baseline:
        return ScaleStatus(_cleared(before, scaling.enabled, baseline), None)
    message = ignored_message(spec.replicas, baseline, scaling, name)
    return ScaleStatus(
        Condition(CONDITION, True, "AutoscalingEnabled", message),
        {"replicas": spec.replicas, "previousReplicas": baseline},
        message if scaled_from is not None else None,
    )


def ignored_message(replicas: int, baseline: int, scaling: Autoscaling, name: str) -> str:
    """What the condition and the Event say: what was ignored, who decides instead, and how to get out of it."""
    who = f"HorizontalPodAutoscaler {name}" if scaling.mode == "hpa" else "the operator's built-in autoscaler"
    return (
        f"spec.replicas {replicas} is ignored: autoscaling is on and {who} sets the replica count, between "
        f"minReplicas {scaling.min_replicas} and maxReplicas {scaling.max_replicas}; change spec.autoscaling to "
        f"scale, turn autoscaling off to run spec.replicas, or set spec.replicas back to {baseline} to clear this"
    )


def _cleared(before: Optional[Mapping[str, Any]], autoscaling: bool, baseline: Optional[int]) -> Optional[Condition]:
    """No scale is ignored now: a True condition becomes False, saying why; a False one stays as it is."""
    if before is None or before.get("status") != "True":
        return _as_condition(before)
    if not autoscaling:
        return Condition(CONDITION, False, "AutoscalingDisabled", "autoscaling is off: spec.replicas sets the replicas")
    back = f"spec.replicas is back at {baseline}" if baseline is not None else "no scale request is ignored"
    return Condition(CONDITION, False, "ReplicasRestored", back)


def _as_condition(rendered: Optional[Mapping[str, Any]]) -> Optional[Condition]:
    """A condition as the status holds it, back as a ``Condition`` (which keeps its lastTransitionTime)."""
    if rendered is None:
        return None
    status = {"True": True, "False": False}.get(str(rendered.get("status")))
    return Condition(CONDITION, status, str(rendered.get("reason", "")), str(rendered.get("message", "")))
