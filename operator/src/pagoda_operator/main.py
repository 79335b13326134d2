"""kopf registrations only; the work happens in ``reconcile``. Run with ``kopf run -m pagoda_operator.main``.

Environment: ``PAGODA_RECONCILE_INTERVAL`` (seconds between periodic reconciles, default 30), which bounds how long
a hand-edited or deleted child stays wrong; ``PAGODA_ENGINE_IMAGE`` (the default engine image);
``PAGODA_AUTOSCALE_INTERVAL`` (seconds between built-in autoscaler ticks, default 15).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any, Optional

import aiohttp
import kopf

from pagoda_operator.autoscaler.loop import autoscale_once, builtin_enabled
from pagoda_operator.child_watch import ChildWatches
from pagoda_operator.constants import GROUP, PLURAL, VERSION
from pagoda_operator.kube import KubeClient, KubeError, login
from pagoda_operator.reconcile import delete_children, reconcile, refresh_owner_status
from pagoda_operator.scale_status import ignored_scale_from
from pagoda_operator.status import status_changes

RECONCILE_INTERVAL = float(os.environ.get("PAGODA_RECONCILE_INTERVAL", "30"))
AUTOSCALE_INTERVAL = float(os.environ.get("PAGODA_AUTOSCALE_INTERVAL", "15"))
RESOURCE = (GROUP, VERSION, PLURAL)


@kopf.on.login()
def login_as_the_client(settings: kopf.OperatorSettings, **_: Any) -> Optional[kopf.ConnectionInfo]:
    """kopf logs in exactly as ``KubeClient`` does (``kube.login``), not through kubernetes_asyncio's loaders."""
    return login(settings)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Log in with kopf's own credential discovery and keep one API session for all handlers."""
    settings.persistence.finalizer = "pagoda.dev/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pagoda.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="pagoda.dev")
    # Under leader election (``run``) the memo carries the elector's fence: our writes stop at its deadline.
    memo.kube = KubeClient.from_environment(settings, fence=memo.get("fence"))
    # Reaches the engine pods (the autoscaler's /metrics, the adapter status); shared by every resource.
    memo.scrape_session = aiohttp.ClientSession()
    # Our Deployments' changes refresh their owners' status at once, not only at the next timer tick.
    refresh = functools.partial(refresh_owner_status, memo.kube, session=memo.scrape_session)
    memo.child_watches = ChildWatches(memo.kube, refresh, clusterwide=settings.peering.clusterwide)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop the Deployment watches, then close the API sessions."""
    await memo.child_watches.close()
    await memo.kube.close()
    await memo.scrape_session.close()


def _lock(memo: kopf.Memo) -> asyncio.Lock:
    """One lock per resource (kopf hands every handler of a resource the same memo): the change handlers, the
    reconcile timer and the autoscaler never interleave their reads and writes of one resource's children, so two
    of them never both create the Deployment or announce it twice."""
    return memo.setdefault("lock", asyncio.Lock())


async def _reconcile_into(
    memo: kopf.Memo, body: kopf.Body, patch: kopf.Patch, scaled_from: Optional[int] = None
) -> None:
    try:
        async with _lock(memo):
            reported = memo.setdefault("reported", {})
            status = await reconcile(memo.kube, body, reported, session=memo.scrape_session, scaled_from=scaled_from)
    except (KubeError, aiohttp.ClientError) as error:
        raise kopf.TemporaryError(f"Kubernetes API call failed: {error}", delay=10) from error
    # Only what changed: a quiet pass writes no status at all.
    patch.status.update(status_changes(body.get("status") or {}, status))


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
async def on_change(memo: kopf.Memo, body: kopf.Body, patch: kopf.Patch, old: Any, new: Any, **_: Any) -> None:
    """Reconcile at once when a ModelDeployment appears, changes, or the operator restarts. ``old``/``new``: the
    specs of an update (kopf's diff base), which tell a ``kubectl scale`` that autoscaling ignores."""
    await _reconcile_into(memo, body, patch, ignored_scale_from(old, new))


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
    kopf.info(
        dict(body),
        reason="Deleted",
        message="deleted its children (Deployment, Service, autoscaler, disruption budget, adapter list)",
    )


@kopf.on.event(*RESOURCE)
async def watch_children(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """Make sure the Deployments of this ModelDeployment's namespace are watched (``child_watch``: selected by the
    API server, unlike a kopf handler on Deployments, which would watch every Deployment in scope)."""
    memo.child_watches.ensure(body.metadata.namespace)


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
