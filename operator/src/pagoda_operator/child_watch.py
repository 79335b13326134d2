"""Watch the operator's own Deployments (selected by the API server) and refresh their owners' status.

kopf's ``@kopf.on.event`` for Deployments watches every Deployment in its scope and filters labels in the operator;
this watch asks the API server for ``app.kubernetes.io/managed-by=pagoda-operator`` only, so other Deployments never
reach the operator. It follows client-go's reflector: list (paginated), watch from the list's resourceVersion with
bookmarks, resume from the last version seen when the server ends a watch, list again on 410 Gone (the version was
compacted away), and reconnect with exponential backoff after any other failure.

Each ADDED or MODIFIED Deployment with an owner label, and each one a (re)list returns (which may stand for events
missed meanwhile), schedules ``refresh`` for its owner. One owner's refreshes never overlap, and events that arrive
during one fold into a single further refresh; different owners are refreshed concurrently.

Only the leader acts: the watches run inside kopf (started by its startup handler, stopped by cleanup), and kopf
runs only on the replica holding the Lease (``pagoda_operator.run``) or on the single ``kopf run --standalone``
replica. Cluster-wide, one watch covers every namespace. With ``--namespace`` (kopf does not tell handlers its
namespaces), a namespace gets its watch when the first ModelDeployment there is reconciled (``ensure``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Optional

from pagoda_operator.builders.meta import MANAGED_BY
from pagoda_operator.kube import WATCH_TIMEOUT_S, KubeClient, KubeError, RetryPolicy, object_path

logger = logging.getLogger(__name__)

SELECTOR = {"app.kubernetes.io/managed-by": MANAGED_BY}
OWNER_LABEL = "pagoda.dev/model-deployment"
Refresh = Callable[[str, str], Awaitable[None]]  # (namespace, ModelDeployment name)
EventSink = Callable[[Mapping[str, Any]], None]
# Reconnect delays: 0.5 s doubling to 30 s (jittered); the watch keeps trying for as long as the operator runs.
RECONNECT = RetryPolicy(attempts=1_000_000, base_delay=0.5, max_delay=30.0)


class OwnerRefresher:
    """Runs ``refresh`` per owner: never two at once for one owner, and a burst of events is one more run."""

    def __init__(self, refresh: Refresh) -> None:
        self._refresh = refresh
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._again: set[tuple[str, str]] = set()

    def schedule(self, namespace: str, name: str) -> None:
        """Refresh this owner soon (after the refresh running for it now, if any)."""
        key = (namespace, name)
        if key in self._running:
            self._again.add(key)
        else:
            self._running[key] = asyncio.create_task(self._run(key), name=f"refresh {namespace}/{name}")

    async def _run(self, key: tuple[str, str]) -> None:
        try:
            while True:
                self._again.discard(key)
                try:
                    await self._refresh(*key)
                except Exception as error:  # noqa: BLE001 - one owner's failure must not stop the others
                    logger.warning("could not refresh the status of ModelDeployment %s/%s: %s", *key, error)
                if key not in self._again:  # the periodic reconcile retries a failed one
                    return
        finally:
            del self._running[key]

    async def close(self) -> None:
        """Cancel the refreshes in flight."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ChildWatch:
    """The reflector loop on one collection (``path``, e.g. the Deployments of a namespace or of the cluster): what
    it lists and watches goes to ``sink`` as ``{"type", "object"}`` events (a list's items as ADDED)."""

    def __init__(self, kube: KubeClient, path: str, sink: EventSink, *, timeout_seconds: int = WATCH_TIMEOUT_S) -> None:
        self.path = path
        self._kube, self._sink, self._timeout = kube, sink, timeout_seconds

    async def run(self, resource_version: Optional[str] = None) -> None:
        """Watch until cancelled; from ``resource_version`` if given (a resumed watch), else from a list."""
        version, failures = resource_version, 0
        while True:
            started, listed = time.monotonic(), not version
            try:
                if not version:
                    items, version = await self._kube.list_with_version(self.path, SELECTOR)
                    for item in items:
                        self._sink({"type": "ADDED", "object": item})
                version, seen = await self._watch_once(version)
                if seen or time.monotonic() - started > 1:
                    failures = 0
                    continue  # the server ended the watch after its timeout: resume from the last version
                reason: object = "the server ended the watch at once"  # do not spin on such a server
            except KubeError as error:
                if error.status == 410:
                    logger.info("watch %s: resourceVersion %s expired; listing again", self.path, version)
                    version = None
                    if not listed:  # a version fresh from a list should not expire: back off before the next
                        continue
                reason = error
            except Exception as error:  # noqa: BLE001 - connection errors, bad JSON, our bugs: never stop watching
                reason = repr(error)
            delay = RECONNECT.backoff(failures)
            failures += 1
            logger.warning("watch %s failed (%s); reconnecting in %.1f s", self.path, reason, delay)
            await asyncio.sleep(delay)

    async def _watch_once(self, version: str) -> tuple[str, int]:
        """One watch request; the last resourceVersion seen (bookmarks included) and how many events came."""
        seen = 0
        async for event in self._kube.watch(self.path, SELECTOR, version, timeout_seconds=self._timeout):
            seen += 1
            version = ((event.get("object") or {}).get("metadata") or {}).get("resourceVersion") or version
            if event.get("type") != "BOOKMARK":
                self._sink(event)
        return version, seen


class ChildWatches:
    """The watches of one operator process and the refresher they feed; ``close()`` stops both."""

    def __init__(self, kube: KubeClient, refresh: Refresh, *, clusterwide: bool) -> None:
        self._kube, self._clusterwide = kube, clusterwide
        self._refresher = OwnerRefresher(refresh)
        self._tasks: dict[Optional[str], asyncio.Task[None]] = {}
        if clusterwide:
            self._start(None)

    def ensure(self, namespace: str) -> None:
        """Make sure the Deployments of ``namespace`` are watched (a no-op cluster-wide)."""
        scope = None if self._clusterwide else namespace
        if scope not in self._tasks:
            self._start(scope)

    def _start(self, scope: Optional[str]) -> None:
        watch = ChildWatch(self._kube, object_path("apps/v1", "deployments", scope), self.on_event)
        self._tasks[scope] = asyncio.create_task(watch.run(), name=f"watch {watch.path}")
        logger.info("watching %s?labelSelector=app.kubernetes.io/managed-by=%s", watch.path, MANAGED_BY)

    def on_event(self, event: Mapping[str, Any]) -> None:
        """Schedule a status refresh for the owner of the Deployment in ``event`` (not for deletions: the owner's
        own deletion or the reconcile that recreates the Deployment reports those)."""
        if event.get("type") == "DELETED":
            return
        meta = (event.get("object") or {}).get("metadata") or {}
        owner = (meta.get("labels") or {}).get(OWNER_LABEL)
        if owner and meta.get("namespace"):
            self._refresher.schedule(meta["namespace"], owner)

    async def close(self) -> None:
        """Stop every watch and the refreshes in flight."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._refresher.close()
