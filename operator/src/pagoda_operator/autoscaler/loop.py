"""One autoscaler tick for one ModelDeployment: observe pods, scrape, decide, scale, and report.

Everything the decision depends on comes from the cluster (pods and their IPs from the API, the Deployment's
replicas, the remembered recommendations from the resource's status), so a restarted operator continues where the
previous one stopped.

The status is written only when the decision or the remembered history changes (``status_update``): a quiet tick
writes nothing, so a steady model does not rewrite its resource (and wake every watcher of it) every tick. The
metric values in ``lastDecision`` are those of the tick at which the decision last changed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Optional

import aiohttp
import kopf

from pagoda_operator.autoscaler.algorithm import Decision, PodSample, decide, from_status, to_status
from pagoda_operator.autoscaler.deletion_cost import deletion_costs, write_deletion_costs
from pagoda_operator.autoscaler.demand import format_stamp, has_demand
from pagoda_operator.autoscaler.scrape import scrape
from pagoda_operator.builders import Owner, replicas_apply, selector_labels
from pagoda_operator.constants import AUTOSCALER_FIELD_MANAGER
from pagoda_operator.kube import KubeClient, object_path
from pagoda_operator.pods import is_ready, pod_url
from pagoda_operator.spec import InvalidSpec, ModelDeploymentSpec, parse_spec

logger = logging.getLogger("pagoda_operator.autoscaler")
# What makes lastDecision a different decision; its metric values alone (waiting, running, kvCacheUsage) change
# with every request and would make every tick of a loaded model a write.
_DECISION_KEYS = ("reason", "currentReplicas", "recommendedReplicas", "podsReady", "podsUnknown")


def builtin_enabled(body: Mapping[str, Any]) -> bool:
    """Whether the built-in autoscaler owns this resource's replicas (valid spec, enabled, mode builtin)."""
    try:
        scaling = parse_spec(body).autoscaling
    except InvalidSpec:
        return False
    return scaling.enabled and scaling.mode == "builtin"


async def sample_pods(session: aiohttp.ClientSession, pods: list[dict[str, Any]], model_name: str) -> list[PodSample]:
    """Scrape every ready pod concurrently; not-ready pods are sampled without metrics."""

    async def one(pod: dict[str, Any]) -> PodSample:
        name = (pod.get("metadata") or {}).get("name", "?")
        if not is_ready(pod):
            return PodSample(name=name, ready=False)
        return PodSample(name, True, await scrape(session, pod_url(pod, "/metrics"), model_name))

    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    return list(await asyncio.gather(*(one(p) for p in live)))


def decision_status(decision: Decision, current: int) -> dict[str, Any]:
    """The status fields that make a decision visible (and the state that survives a restart)."""
    m = decision.metrics
    status: dict[str, Any] = {
        "desiredReplicas": decision.desired,
        "lastDecision": {
            "reason": decision.reason,
            "currentReplicas": current,
            "recommendedReplicas": decision.raw,
            "waiting": m.waiting,
            "running": m.running,
            "kvCacheUsage": m.kv_cache_usage,
            "podsReady": m.pods_ready,
            "podsUnknown": m.pods_unknown,
        },
        "autoscaler": to_status(decision.state),
    }
    if decision.state.last_scale_time is not None:
        status["lastScaleTime"] = format_stamp(decision.state.last_scale_time)
    return status


def _without_nulls(value: Any) -> Any:
    """``value`` as the status stores it: a merge patch deletes the keys it sets to null."""
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def status_update(previous: Mapping[str, Any], status: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The fields of ``status`` to write over ``previous`` (the live status), or None on a quiet tick."""
    changes: dict[str, Any] = {}
    for key, value in status.items():
        old = previous.get(key)
        if key == "lastDecision":
            old = old or {}
            changed = any(old.get(k) != value.get(k) for k in _DECISION_KEYS)
        else:
            changed = _without_nulls(old) != _without_nulls(value)
        if changed:
            changes[key] = value
    return changes or None


def describe(decision: Decision, current: int) -> str:
    """One line with the facts behind a decision, for the Event and the log."""
    m = decision.metrics
    kv = "unknown" if m.kv_cache_usage is None else f"{m.kv_cache_usage:.2f}"
    return (
        f"{decision.reason}: replicas {current} -> {decision.desired} (waiting={m.waiting:g} running={m.running:g} "
        f"kvCacheUsage={kv} podsReady={m.pods_ready} podsUnknown={m.pods_unknown})"
    )


def event_reason(desired: int, current: int) -> str:
    """The Event's reason for a change of replicas: from and to zero are named, as they start or stop a model."""
    if current == 0:
        return "ScaledFromZero"
    if desired == 0:
        return "ScaledToZero"
    return "ScaledUp" if desired > current else "ScaledDown"


async def autoscale_once(
    kube: KubeClient,
    session: aiohttp.ClientSession,
    body: Mapping[str, Any],
    now: float,
) -> Optional[dict[str, Any]]:
    """Run one tick; returns the status fields to patch, or None when there is nothing to scale yet or nothing
    changed. Before a scale-down, each Ready pod's deletion cost says how busy it is (see ``deletion_cost``)."""
    spec: ModelDeploymentSpec = parse_spec(body)
    owner = Owner.from_body(body)
    deployment_path = object_path("apps/v1", "deployments", owner.namespace, owner.name)
    deployment = await kube.get(deployment_path)
    if deployment is None:
        return None
    current = int((deployment.get("spec") or {}).get("replicas", 1))
    pods = await kube.list(object_path("v1", "pods", owner.namespace), selector_labels(owner))
    samples = await sample_pods(session, pods, spec.served_model_name)
    state = from_status((body.get("status") or {}).get("autoscaler"))
    # The router's demand stamp is read from the body kopf handed this tick (the annotation, not replicas, is all
    # the router writes), so the decision stays a function of what the cluster holds.
    decision = decide(samples, state, spec.autoscaling, current, now, demand=has_demand(body, now))
    if decision.desired < current:
        await write_deletion_costs(kube, owner.namespace, deletion_costs(pods, samples))
    if decision.desired != current:
        await kube.apply(replicas_apply(owner, decision.desired), manager=AUTOSCALER_FIELD_MANAGER)
        message = describe(decision, current)
        kopf.info(dict(body), reason=event_reason(decision.desired, current), message=message)
        logger.info(f"ModelDeployment {owner.namespace}/{owner.name}: {message}")
    else:
        logger.debug(f"ModelDeployment {owner.namespace}/{owner.name}: {describe(decision, current)}")
    return status_update(body.get("status") or {}, decision_status(decision, current))
