"""kopf registrations only; the work happens in ``reconcile``. Run with ``kopf run -m pagoda_operator.main``.

Environment: ``PAGODA_RECONCILE_INTERVAL`` (seconds between periodic reconciles, default 30), which bounds how long
a hand-edited or deleted child stays wrong; ``PAGODA_ENGINE_IMAGE`` (the default engine image);
``PAGODA_AUTOSCALE_INTERVAL`` (seconds between built-in autoscaler ticks, default 15).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import aiohttp
import kopf

from pagoda_operator.autoscaler.loop import autoscale_once, builtin_enabled
from pagoda_operator.builders.meta import MANAGED_BY
from pagoda_operator.constants import GROUP, PLURAL, VERSION
from pagoda_operator.kube import KubeClient, KubeError
from pagoda_operator.reconcile import delete_children, reconcile, refresh_owner_status
from pagoda_operator.status import status_changes

RECONCILE_INTERVAL = float(os.environ.get("PAGODA_RECONCILE_INTERVAL", "30"))
AUTOSCALE_INTERVAL = float(os.environ.get("PAGODA_AUTOSCALE_INTERVAL", "15"))
RESOURCE = (GROUP, VERSION, PLURAL)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Log in with kopf's own credential discovery and keep one API session for all handlers."""
    settings.persistence.finalizer = "pagoda.dev/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pagoda.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="pagoda.dev")
    memo.kube = KubeClient.from_environment(settings)
    # Reaches the engine pods (the autoscaler's /metrics, the adapter status); shared by every resource.
    memo.scrape_session = aiohttp.ClientSession()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Close the API sessions."""
    await memo.kube.close()
    await memo.scrape_session.close()


def _lock(memo: kopf.Memo) -> asyncio.Lock:
    """One lock per resource (kopf hands every handler of a resource the same memo): the change handlers, the
    reconcile timer and the autoscaler never interleave their reads and writes of one resource's children, so two
    of them never both create the Deployment or announce it twice."""
    return memo.setdefault("lock", asyncio.Lock())


async def _reconcile_into(memo: kopf.Memo, body: kopf.Body, patch: kopf.Patch) -> None:
    try:
        async with _lock(memo):
            status = await reconcile(memo.kube, body, memo.setdefault("reported", {}), session=memo.scrape_session)
    except (KubeError, aiohttp.ClientError) as error:
        raise kopf.TemporaryError(f"Kubernetes API call failed: {error}", delay=10) from error
    # Only what changed: a quiet pass writes no status at all.
    patch.status.update(status_changes(body.get("status") or {}, status))


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
async def on_change(memo: kopf.Memo, body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Reconcile at once when a ModelDeployment appears, changes, or the operator restarts."""
    await _reconcile_into(memo, body, patch)


@kopf.timer(*RESOURCE, interval=RECONCILE_INTERVAL)
async def periodic(memo: kopf.Memo, body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Restore hand-edited or deleted children and refresh the status from the Deployment and its pods."""
    await _reconcile_into(memo, body, patch)


@kopf.on.delete(*RESOURCE)
async def on_delete(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """Delete the children explicitly, then let kopf drop the finalizer."""
    try:
        await delete_children(memo.kube, body)
    except (KubeError, aiohttp.ClientError) as error:
        raise kopf.TemporaryError(f"deleting children failed: {error}", delay=10) from error
    kopf.info(dict(body), reason="Deleted", message="deleted the Deployment, Service and autoscaler")


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
async def on_deployment_event(
    memo: kopf.Memo, body: kopf.Body, event: kopf.RawEvent, logger: kopf.Logger, **_: Any
) -> None:
    """Refresh the owner's status as soon as its Deployment's status changes, not only at the next timer tick."""
    owner = body.get("metadata", {}).get("labels", {}).get("pagoda.dev/model-deployment")
    if not owner or event.get("type") == "DELETED":
        return
    try:
        await refresh_owner_status(memo.kube, body.metadata.namespace, owner, memo.scrape_session)
    except (KubeError, aiohttp.ClientError) as error:
        logger.warning(f"could not refresh the status of ModelDeployment {owner}: {error}")  # the timer retries


def _builtin_autoscaling(body: kopf.Body, **_: Any) -> bool:
    return builtin_enabled(body)


@kopf.timer(*RESOURCE, interval=AUTOSCALE_INTERVAL, when=_builtin_autoscaling)
async def autoscale(memo: kopf.Memo, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    """The built-in autoscaler (``autoscaling.mode: builtin`` only; with ``hpa`` the HPA scales and this stays off)."""
    if not builtin_enabled(body):  # the spec may have changed since kopf checked the filter
        return
    try:
        async with _lock(memo):
            status = await autoscale_once(memo.kube, memo.scrape_session, body, time.time())
    except (KubeError, aiohttp.ClientError) as error:
        logger.warning(f"autoscaler tick failed, the next one retries: {error}")
        return
    if status is not None:
        patch.status.update(status)
