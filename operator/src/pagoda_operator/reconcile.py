"""Thin glue between kopf and the pure parts: parse the spec, apply the children, observe them, compute status.

Children are looked up by name (they share the ModelDeployment's name), never by listing, so a reconcile costs a few
GETs. A child is written only when it is missing (create), when its applied-config hash differs from the desired
one (the spec changed), or when a field the operator sets was edited by hand; every write is logged as an Event.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Mapping
from typing import Any, Optional

import kopf

from pagoda_operator.builders import Owner, build_deployment, build_hpa, build_service, selector_labels, selector_string
from pagoda_operator.builders.service import endpoint_url
from pagoda_operator.capabilities import check_capabilities
from pagoda_operator.constants import API_VERSION, PLURAL
from pagoda_operator.kube import KubeClient, object_path, path_of
from pagoda_operator.spec import InvalidSpec, ModelDeploymentSpec, parse_spec
from pagoda_operator.status import compute_status

HASH_ANNOTATION = "pagoda.dev/applied-hash"


def _hashed(obj: dict[str, Any]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    obj["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = digest
    return obj


def contains(live: Any, desired: Any) -> bool:
    """Whether every field of ``desired`` has the same value in ``live`` (the API server adds defaults)."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(contains(live.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    # Quantities come back as strings ("2" for 2); booleans and strings must match exactly.
    return live == desired or (
        isinstance(desired, int | float) and not isinstance(desired, bool) and str(live) == str(desired)
    )


async def _ensure(kube: KubeClient, body: Mapping[str, Any], desired: dict[str, Any], creation: dict[str, Any]) -> None:
    kind, name = desired["kind"], desired["metadata"]["name"]
    live = await kube.get(path_of(desired))
    if live is None:
        await kube.create(path_of(desired).rsplit("/", 1)[0], _hashed(creation))
        kopf.info(dict(body), reason="Created", message=f"created {kind} {name}")
    elif not contains(live, _hashed(desired)):
        await kube.apply(desired)
        kopf.info(dict(body), reason="Updated", message=f"applied {kind} {name}")


async def apply_children(kube: KubeClient, body: Mapping[str, Any], spec: ModelDeploymentSpec, owner: Owner) -> None:
    """Create or re-apply the Deployment, Service and HPA; delete an HPA that is no longer wanted."""
    autoscaled = spec.autoscaling.enabled
    deployment = build_deployment(spec, owner, include_replicas=not autoscaled)
    await _ensure(kube, body, deployment, build_deployment(spec, owner, include_replicas=True))
    service = build_service(spec, owner)
    await _ensure(kube, body, service, build_service(spec, owner))
    hpa = build_hpa(spec, owner)
    hpa_path = object_path("autoscaling/v2", "horizontalpodautoscalers", owner.namespace, owner.name)
    if hpa is not None:
        await _ensure(kube, body, hpa, build_hpa(spec, owner) or {})
    elif await kube.delete(hpa_path):
        kopf.info(dict(body), reason="Deleted", message=f"deleted HorizontalPodAutoscaler {owner.name}")


async def delete_children(kube: KubeClient, body: Mapping[str, Any]) -> None:
    """Delete every child by name: works without a garbage collector, and owner references cover the rest."""
    meta = body["metadata"]
    for api_version, plural in (
        ("autoscaling/v2", "horizontalpodautoscalers"),
        ("v1", "services"),
        ("apps/v1", "deployments"),
    ):
        await kube.delete(object_path(api_version, plural, meta["namespace"], meta["name"]))


def _report_invalid(body: Mapping[str, Any], error: InvalidSpec, reported: dict[str, str]) -> None:
    # Only on a change: the timer re-reconciles an invalid resource every interval and must not spam events.
    # ``reported`` (the resource's kopf memo) covers handlers racing on a body whose status is not patched yet;
    # the status check covers operator restarts.
    previous = [c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Degraded"]
    in_status = (
        bool(previous) and previous[0].get("reason") == "InvalidSpec" and error.field in previous[0].get("message", "")
    )
    if reported.get("invalid") != str(error) and not in_status:
        kopf.warn(dict(body), reason="InvalidSpec", message=str(error))
    reported["invalid"] = str(error)


def validated_spec(body: Mapping[str, Any]) -> ModelDeploymentSpec:
    """The parsed spec, if this engine can serve it (its capability contract); else ``InvalidSpec``."""
    spec = parse_spec(body)
    check_capabilities(spec)
    return spec


async def observe(
    kube: KubeClient,
    body: Mapping[str, Any],
    error: Optional[InvalidSpec],
    endpoint: Optional[str],
    now: datetime.datetime,
    served_model_name: Optional[str] = None,
) -> dict[str, Any]:
    """The status for what the Deployment and its pods show right now (reads only)."""
    owner = Owner.from_body(body)
    deployment = await kube.get(object_path("apps/v1", "deployments", owner.namespace, owner.name))
    pods = await kube.list(object_path("v1", "pods", owner.namespace), selector_labels(owner)) if deployment else []
    return compute_status(
        error=error,
        deployment=deployment,
        pods=pods,
        previous=body.get("status") or {},
        generation=(body.get("metadata") or {}).get("generation"),
        selector=selector_string(owner),
        endpoint=endpoint,
        now=now,
        served_model_name=served_model_name,
    )


async def reconcile(
    kube: KubeClient,
    body: Mapping[str, Any],
    reported: Optional[dict[str, str]] = None,
    now: Optional[datetime.datetime] = None,
) -> dict[str, Any]:
    """Bring the children in line with the spec (unless it is invalid) and return the status to patch.

    ``reported`` remembers what was already announced in Events for this resource (kopf keeps it per resource).
    """
    owner = Owner.from_body(body)
    error: Optional[InvalidSpec] = None
    endpoint: Optional[str] = None
    served: Optional[str] = None
    try:
        spec = validated_spec(body)
    except InvalidSpec as exc:
        error = exc
        _report_invalid(body, exc, {} if reported is None else reported)
    else:
        if reported is not None:
            reported.pop("invalid", None)  # a later, identical mistake is news again
        await apply_children(kube, body, spec, owner)
        endpoint, served = endpoint_url(spec, owner), spec.served_model_name
    return await observe(kube, body, error, endpoint, now or datetime.datetime.now(datetime.UTC), served)


async def refresh_owner_status(kube: KubeClient, namespace: str, name: str) -> None:
    """Recompute and patch a ModelDeployment's status after its Deployment changed, without touching children."""
    path = object_path(API_VERSION, PLURAL, namespace, name)
    body = await kube.get(path)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return
    error: Optional[InvalidSpec] = None
    endpoint: Optional[str] = None
    served: Optional[str] = None
    try:
        spec = validated_spec(body)
        endpoint, served = endpoint_url(spec, Owner.from_body(body)), spec.served_model_name
    except InvalidSpec as exc:
        error = exc
    status = await observe(kube, body, error, endpoint, datetime.datetime.now(datetime.UTC), served)
    await kube.merge_patch(f"{path}/status", {"status": status})
