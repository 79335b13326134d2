"""Thin glue between kopf and the pure parts: parse the spec, apply the children, observe them, compute status.

Children are looked up by name (they share the ModelDeployment's name), never by listing, so a reconcile costs a few
GETs. Every write is a server-side apply with the operator's field manager, creation included, so the operator
owns exactly the fields it sets: a field removed from the spec is removed from the child, a hand edit of a field it
sets is reverted, and fields set by others are left alone. Before writing, a dry-run apply shows what the child
would become; when that equals the live object nothing is written and no Event is posted, so a quiet reconcile
makes no writes at all. The status is written only where it changed (``status_changes``).

With LoRA on, the adapter list ConfigMap is applied before the Deployment (its pods mount it), and the status says
which adapters the Ready pods have loaded (``lora_status``: one HTTP GET per Ready pod per pass). A resource that
never runs on fewer than two replicas also gets a PodDisruptionBudget (``builders.disruption``).

Children of other projects' kinds (``spec.routing``: InferencePool, InferenceObjective; autoscaling mode ``keda``:
ScaledObject) need those projects' CRDs. Where the API server does not know the kind (404 on the apply), the
reconcile goes on without it: the other children are applied, the status shows ``RoutingAvailable`` or
``KedaAvailable`` False (reason ``RoutingUnavailable``, ``KedaUnavailable``) and one Warning Event says so (once per
change, as for an invalid spec); the next pass after the CRD is installed applies the child and sets it True.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, Optional

import aiohttp
import kopf

from pagoda_operator.builders import (
    Owner,
    build_children,
    build_deployment,
    lora_config_map_name,
    replicas_apply,
    selector_labels,
    selector_string,
)
from pagoda_operator.builders.disruption import PDB_API_VERSION, PDB_PLURAL
from pagoda_operator.builders.keda import SCALED_OBJECT_API_VERSION
from pagoda_operator.builders.routing import INFERENCE_OBJECTIVE_API_VERSION, INFERENCE_POOL_API_VERSION
from pagoda_operator.builders.service import endpoint_url
from pagoda_operator.capabilities import check_capabilities
from pagoda_operator.conditions import Condition, find_condition
from pagoda_operator.constants import API_VERSION, AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER, PLURAL
from pagoda_operator.kube import KubeClient, KubeError, object_path, path_of
from pagoda_operator.lora_status import observe_lora
from pagoda_operator.scale_status import ScaleStatus, scale_status
from pagoda_operator.spec import InvalidSpec, ModelDeploymentSpec, parse_spec
from pagoda_operator.status import compute_status, status_changes

# What every write changes by itself (or what no apply sets): not a difference worth writing for.
_VOLATILE_METADATA = frozenset({"managedFields", "resourceVersion", "generation"})
# Where each kind of child lives, in the order ``delete_children`` deletes them.
_CHILD_RESOURCES = {
    "ScaledObject": (SCALED_OBJECT_API_VERSION, "scaledobjects"),  # before the HPA: KEDA's own HPA goes with it
    "InferenceObjective": (INFERENCE_OBJECTIVE_API_VERSION, "inferenceobjectives"),
    "InferencePool": (INFERENCE_POOL_API_VERSION, "inferencepools"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "PodDisruptionBudget": (PDB_API_VERSION, PDB_PLURAL),
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "ConfigMap": ("v1", "configmaps"),
}
# The children a spec may do without (``build_children`` gives None): the reconciler deletes one no longer wanted.
_OPTIONAL_CHILDREN = (
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "InferencePool",
    "InferenceObjective",
    "ScaledObject",
)
# Kinds of other projects' CRDs, by the condition that says whether the API server knows them: (condition type,
# reason while unknown, kinds, what to install).
_INTEGRATIONS = (
    (
        "RoutingAvailable",
        "RoutingUnavailable",
        ("InferencePool", "InferenceObjective"),
        "the Gateway API Inference Extension CRDs",
    ),
    ("KedaAvailable", "KedaUnavailable", ("ScaledObject",), "KEDA"),
)
_THIRD_PARTY = frozenset(kind for _, _, kinds, _ in _INTEGRATIONS for kind in kinds)


def child_name(kind: str, owner: Owner) -> str:
    """The name of ``owner``'s child of ``kind``: the owner's own, but the adapter list has one of its own."""
    return lora_config_map_name(owner) if kind == "ConfigMap" else owner.name


def child_path(kind: str, owner: Owner) -> str:
    """The REST path of ``owner``'s child of ``kind``."""
    api_version, plural = _CHILD_RESOURCES[kind]
    return object_path(api_version, plural, owner.namespace, child_name(kind, owner))


def comparable(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` without its status and the metadata the API server bumps on every write."""
    out = {k: v for k, v in obj.items() if k != "status"}
    out["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in _VOLATILE_METADATA}
    if obj.get("kind") == "HorizontalPodAutoscaler" and isinstance((obj.get("spec") or {}).get("metrics"), list):
        # API servers before 1.28 return a dry-run apply of an autoscaling/v2 HPA with its first metric duplicated
        # (kubernetes#118293); the real apply never stores the copy. Compared with duplicates dropped, a quiet
        # reconcile does not re-apply (and announce) every HPA on every pass.
        metrics: list[Any] = []
        for metric in obj["spec"]["metrics"]:
            if metric not in metrics:
                metrics.append(metric)
        out["spec"] = {**obj["spec"], "metrics": metrics}
    return out


def owns_replicas(deployment: Mapping[str, Any], manager: str) -> bool:
    """Whether ``manager`` is among the owners of ``spec.replicas`` (per the object's managed fields)."""
    for entry in (deployment.get("metadata") or {}).get("managedFields") or []:
        fields = entry.get("fieldsV1") or {}
        if entry.get("manager") == manager and "f:replicas" in (fields.get("f:spec") or {}):
            return True
    return False


_UNREAD: Any = object()


async def _ensure(
    kube: KubeClient, body: Mapping[str, Any], desired: dict[str, Any], force: bool = False, live: Any = _UNREAD
) -> None:
    """Apply ``desired`` if that changes the child (or ``force``); an Event for every write. ``live``: the child as
    the caller just read it (None: missing), to save reading it again."""
    kind, name = desired["kind"], desired["metadata"]["name"]
    if live is _UNREAD:
        live = await kube.get(path_of(desired))
    if live is not None and not force:
        would_be = await kube.apply(desired, dry_run=True)
        if _version(would_be) != _version(live):  # a controller wrote in between: compare with what it wrote
            live = await kube.get(path_of(desired)) or live
        if comparable(live) == comparable(would_be):
            return
    await kube.apply(desired)
    if live is None:
        kopf.info(dict(body), reason="Created", message=f"created {kind} {name}")
    else:
        kopf.info(dict(body), reason="Updated", message=f"applied {kind} {name}")


def _version(obj: Mapping[str, Any]) -> Optional[str]:
    return (obj.get("metadata") or {}).get("resourceVersion")


async def _hand_replicas_to_autoscaler(kube: KubeClient, owner: Owner, replicas: int) -> None:
    """Make the autoscaler's field manager an owner of the Deployment's replicas, at their current value."""
    await kube.apply(replicas_apply(owner, replicas), manager=AUTOSCALER_FIELD_MANAGER)


async def _apply_deployment(
    kube: KubeClient, body: Mapping[str, Any], spec: ModelDeploymentSpec, owner: Owner, deployment: dict[str, Any]
) -> None:
    """The Deployment (``deployment``: with ``spec.replicas`` when autoscaling is off, without replicas when it is on).
    Turning autoscaling on keeps the live count: the autoscaler's manager takes the field over before the operator's
    apply leaves it out (an apply that omits a field it alone owned would remove it, and the Deployment would drop
    to 1 replica)."""
    if not spec.autoscaling.enabled:
        await _ensure(kube, body, deployment)
        return
    live = await kube.get(child_path("Deployment", owner))
    if live is None:  # created at minReplicas
        await _ensure(kube, body, build_deployment(spec, owner, include_replicas=True), live=None)
        await _hand_replicas_to_autoscaler(kube, owner, spec.autoscaling.min_replicas)
        await kube.apply(deployment)  # the operator lets go of replicas
    elif owns_replicas(live, FIELD_MANAGER):  # autoscaling was just switched on
        await _hand_replicas_to_autoscaler(kube, owner, int((live.get("spec") or {}).get("replicas", 1)))
        await _ensure(kube, body, deployment, force=True, live=live)
    else:
        await _ensure(kube, body, deployment, live=live)


async def _delete_child(kube: KubeClient, body: Mapping[str, Any], kind: str, owner: Owner) -> None:
    """Delete a child that is no longer wanted, if it is there (an Event when it was)."""
    path = child_path(kind, owner)
    if await kube.get(path) is not None and await kube.delete(path):
        kopf.info(dict(body), reason="Deleted", message=f"deleted {kind} {child_name(kind, owner)}")


async def apply_children(
    kube: KubeClient, body: Mapping[str, Any], spec: ModelDeploymentSpec, owner: Owner
) -> set[str]:
    """Create or re-apply the adapter list, Deployment, Service, HPA, disruption budget, InferencePool,
    InferenceObjective and ScaledObject; delete the ones no longer wanted. Returns the wanted kinds the API server
    does not know (their CRD is not installed), which were skipped."""
    # with autoscaling on, the operator's apply leaves replicas to the autoscaler (built once per pass)
    children = build_children(spec, owner, include_replicas=not spec.autoscaling.enabled)
    config_map, deployment, service = children["ConfigMap"], children["Deployment"], children["Service"]
    assert deployment is not None and service is not None  # every spec has these two
    if config_map is not None:
        await _ensure(kube, body, config_map)  # before the Deployment: its pods mount it
    await _apply_deployment(kube, body, spec, owner, deployment)
    await _ensure(kube, body, service)
    missing: set[str] = set()
    for kind in _OPTIONAL_CHILDREN:
        manifest = children[kind]
        try:
            if manifest is not None:
                await _ensure(kube, body, manifest)
            else:  # a GET of an unknown kind is a 404 too: nothing to delete
                await _delete_child(kube, body, kind, owner)
        except KubeError as error:
            if error.status != 404 or kind not in _THIRD_PARTY:
                raise
            missing.add(kind)  # an apply found no such resource type: its CRD is not installed
    if config_map is None:  # LoRA off: after the Deployment, whose new template no longer mounts it
        await _delete_child(kube, body, "ConfigMap", owner)
    return missing


def _wanted_third_party(spec: ModelDeploymentSpec) -> set[str]:
    """The kinds of other projects' CRDs this spec wants (see ``builders.children``)."""
    wanted = set()
    if spec.routing.inference_pool:
        wanted |= {"InferencePool"} | ({"InferenceObjective"} if spec.routing.objective_priority is not None else set())
    if spec.autoscaling.enabled and spec.autoscaling.mode == "keda":
        wanted.add("ScaledObject")
    return wanted


def integration_conditions(
    spec: Optional[ModelDeploymentSpec], missing: Optional[set[str]], previous: Mapping[str, Any]
) -> list[Condition]:
    """RoutingAvailable and KedaAvailable, each only while the spec wants one of its kinds: False naming the kinds
    in ``missing`` (what this pass could not apply), else True. ``missing`` None (a pass that applied nothing, such
    as a Deployment watch refresh): the conditions as ``previous`` (the live status) holds them."""
    conditions: list[Condition] = []
    wanted = _wanted_third_party(spec) if spec is not None else set()
    for kind_of_condition, reason, kinds, install in _INTEGRATIONS:
        ours = [kind for kind in kinds if kind in wanted]
        if not ours:
            continue
        if missing is None:
            live = find_condition(previous, kind_of_condition)
            if live is not None:
                status = {"True": True, "False": False}.get(live.get("status", ""))
                conditions.append(Condition(kind_of_condition, status, live["reason"], live.get("message", "")))
            continue
        absent = [kind for kind in ours if kind in missing]
        if absent:
            message = f"the API server does not know {', '.join(absent)}: install {install}; other children applied"
            conditions.append(Condition(kind_of_condition, False, reason, message))
        else:
            conditions.append(Condition(kind_of_condition, True, "Applied", f"applied {', '.join(ours)}"))
    return conditions


def _report_unavailable(body: Mapping[str, Any], conditions: list[Condition], reported: dict[str, str]) -> None:
    """One Warning per missing integration and change (the memo and the live status, as ``_report_invalid``)."""
    for condition in conditions:
        key = f"unavailable:{condition.type}"
        if condition.status is not False:
            reported.pop(key, None)  # available again: a later loss is news
            continue
        live = find_condition(body.get("status") or {}, condition.type) or {}
        in_status = live.get("status") == "False" and live.get("message") == condition.message
        if reported.get(key) != condition.message and not in_status:
            kopf.warn(dict(body), reason=condition.reason, message=condition.message)
        reported[key] = condition.message


async def delete_children(kube: KubeClient, body: Mapping[str, Any]) -> None:
    """Delete every child by name: works without a garbage collector, and owner references cover the rest."""
    owner = Owner.from_body(body)
    for kind in _CHILD_RESOURCES:
        await kube.delete(child_path(kind, owner))


def _report_invalid(body: Mapping[str, Any], error: InvalidSpec, reported: dict[str, str]) -> None:
    # Only on a change: the timer re-reconciles an invalid resource every interval and must not spam events.
    # ``reported`` (the resource's kopf memo) covers handlers racing on a body whose status is not patched yet;
    # the status check covers operator restarts.
    degraded = find_condition(body.get("status") or {}, "Degraded") or {}
    in_status = degraded.get("reason") == "InvalidSpec" and error.field in degraded.get("message", "")
    if reported.get("invalid") != str(error) and not in_status:
        kopf.warn(dict(body), reason="InvalidSpec", message=str(error))
    reported["invalid"] = str(error)


def validated_spec(body: Mapping[str, Any]) -> ModelDeploymentSpec:
    """The parsed spec, if this engine can serve it (its capability contract); else ``InvalidSpec``."""
    spec = parse_spec(body)
    check_capabilities(spec)
    return spec


def spec_or_error(body: Mapping[str, Any]) -> tuple[Optional[ModelDeploymentSpec], Optional[InvalidSpec]]:
    """``(validated_spec(body), None)``, or ``(None, why it is invalid)``: one of the two is None."""
    try:
        return validated_spec(body), None
    except InvalidSpec as error:
        return None, error


async def observe(
    kube: KubeClient,
    body: Mapping[str, Any],
    spec: Optional[ModelDeploymentSpec],
    error: Optional[InvalidSpec],
    now: datetime.datetime,
    session: Optional[aiohttp.ClientSession] = None,
    scale: Optional[ScaleStatus] = None,
    missing: Optional[set[str]] = None,
) -> dict[str, Any]:
    """The status for what the Deployment and its pods show right now (reads only; ``spec`` None while invalid).
    With ``session``, the Ready pods are asked which adapters they have loaded. ``scale``: the ignored-scale status
    when the caller worked it out (it saw a change of spec.replicas); by default the one the status already holds.
    ``missing``: the kinds ``apply_children`` could not apply this pass (None: it did not run; see
    ``integration_conditions``)."""
    owner = Owner.from_body(body)
    previous = body.get("status") or {}
    deployment = await kube.get(child_path("Deployment", owner))
    pods = await kube.list(object_path("v1", "pods", owner.namespace), selector_labels(owner)) if deployment else []
    return compute_status(
        error=error,
        deployment=deployment,
        pods=pods,
        previous=previous,
        generation=(body.get("metadata") or {}).get("generation"),
        selector=selector_string(owner),
        endpoint=endpoint_url(spec, owner) if spec else None,
        now=now,
        served_model_name=spec.served_model_name if spec else None,
        lora=await observe_lora(session, spec, pods),
        scale=scale or scale_status(spec, owner.name, previous),
        extra=integration_conditions(spec, missing, previous),
    )


async def reconcile(
    kube: KubeClient,
    body: Mapping[str, Any],
    reported: Optional[dict[str, str]] = None,
    now: Optional[datetime.datetime] = None,
    session: Optional[aiohttp.ClientSession] = None,
    scaled_from: Optional[int] = None,
) -> dict[str, Any]:
    """Bring the children in line with the spec (unless it is invalid) and return the status to patch.

    ``reported`` remembers what was already announced in Events for this resource (kopf keeps it per resource);
    ``session`` reaches the pods over HTTP for the adapter status; ``scaled_from``: spec.replicas before the change
    being handled, when autoscaling ignores that change (``scale_status.ignored_scale_from``).
    """
    owner = Owner.from_body(body)
    spec, error = spec_or_error(body)
    reported = {} if reported is None else reported
    missing: Optional[set[str]] = None
    if error is not None:
        _report_invalid(body, error, reported)
    elif spec is not None:
        reported.pop("invalid", None)  # a later, identical mistake is news again
        missing = await apply_children(kube, body, spec, owner)
        _report_unavailable(body, integration_conditions(spec, missing, {}), reported)
    scale = scale_status(spec, owner.name, body.get("status") or {}, scaled_from)
    now = now or datetime.datetime.now(datetime.UTC)
    status = await observe(kube, body, spec, error, now, session, scale, missing)
    if scale.warning:  # only once the pass worked: a failed pass is retried, and would warn twice
        kopf.warn(dict(body), reason="ScaleIgnored", message=scale.warning)
    return status


async def refresh_owner_status(
    kube: KubeClient, namespace: str, name: str, session: Optional[aiohttp.ClientSession] = None
) -> None:
    """Recompute a ModelDeployment's status after its Deployment changed, without touching children, and patch
    what changed."""
    path = object_path(API_VERSION, PLURAL, namespace, name)
    body = await kube.get(path)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return
    spec, error = spec_or_error(body)
    status = await observe(kube, body, spec, error, datetime.datetime.now(datetime.UTC), session)
    changes = status_changes(body.get("status") or {}, status)
    if changes:
        await kube.merge_patch(f"{path}/status", {"status": changes})
