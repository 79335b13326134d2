"""Leader election on a ``coordination.k8s.io/v1`` Lease, as Kubernetes' own controllers do it, with fenced writes.

One replica holds the Lease and runs the operator; the others stand by and take it over once the holder has not
renewed it for ``lease_seconds``. Expiry is judged by when this replica last saw the Lease change (its own
monotonic clock), never by comparing another node's timestamps with ours, so clock skew between nodes cannot hand
the Lease to two replicas. Writes carry the resourceVersion they read: of two standbys racing for an expired Lease
one gets a 409 and keeps waiting.

Why two leaders cannot act at once. A standby takes the Lease only after seeing it unchanged for ``lease_seconds``
by its own clock, and it can see a renewal only after the holder sent it. So the holder may act until
``renew_deadline`` (2/3 of the lease by default) after it *sent* its last successful renewal, and never later:

- every renewal attempt is cut off (``asyncio.wait_for``) when that deadline comes, however slow the API server
  is, and ``keep`` returns then: the caller stops acting;
- ``is_leading``/``fence`` answer from the same deadline (monotonic clock), and the operator's writes consult the
  fence before each request (``KubeClient(fence=...)`` for ours, ``fence_kopf_writes`` for kopf's own), so a
  holder whose kopf has not stopped yet, or one that was frozen (SIGSTOP, a VM pause) and resumes long after its
  deadline, is refused every write: nothing runs between waking up and the check.

What remains is a write sent just before the deadline that the network holds back until after a standby took
over: the gap between deadline and takeover (``lease_seconds - renew_deadline``, 1/3 of the lease, plus the
standby's polling period) is the margin for that, as in client-go, whose leader election has the same bound.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from pagoda_operator.kube import KubeClient, KubeError, object_path

logger = logging.getLogger(__name__)

# The default renew deadline as a share of the lease: the last third is the margin before a standby may take over.
RENEW_DEADLINE_FRACTION = 2 / 3


class LeadershipLost(Exception):
    """A write refused because this replica may no longer act as the leader (its renew deadline has passed)."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(slots=True)
class LeaseElector:
    """Acquire, then keep, the Lease ``namespace/name`` for ``identity``.

    ``renew_deadline``: seconds after sending the last successful renewal that this replica stops acting (0: 2/3
    of ``lease_seconds``); it must be below ``lease_seconds`` and above ``retry_seconds``."""

    kube: KubeClient
    namespace: str
    name: str
    identity: str
    lease_seconds: int = 10
    retry_seconds: float = 2.0
    renew_deadline: float = 0.0
    _seen: Optional[tuple[str, str]] = None  # (holder, renewTime) last observed
    _seen_at: float = 0.0  # monotonic time it was observed (or changed)
    _leading_until: float = 0.0  # monotonic deadline to stop acting by; 0: not leading

    def __post_init__(self) -> None:
        if not self.renew_deadline:
            self.renew_deadline = self.lease_seconds * RENEW_DEADLINE_FRACTION
        if not self.retry_seconds < self.renew_deadline < self.lease_seconds:
            raise ValueError(
                f"need retry_seconds < renew_deadline < lease_seconds, got {self.retry_seconds}, "
                f"{self.renew_deadline:.2f}, {self.lease_seconds}"
            )

    @property
    def path(self) -> str:
        return object_path("coordination.k8s.io/v1", "leases", self.namespace, self.name)

    @property
    def deadline(self) -> float:
        """The monotonic time this replica must stop acting by (0 while it is not the leader)."""
        return self._leading_until

    def is_leading(self) -> bool:
        """Whether this replica may act now: it holds the Lease and its renew deadline has not passed."""
        return time.monotonic() < self._leading_until

    def fence(self) -> None:
        """Raise ``LeadershipLost`` unless this replica may act now; writes call it just before each request."""
        if not self.is_leading():
            raise LeadershipLost(f"{self.identity} no longer leads {self.namespace}/{self.name}: write refused")

    async def acquire(self) -> None:
        """Return once this replica holds the Lease (standing by meanwhile)."""
        while not await self.try_acquire():
            await asyncio.sleep(self.retry_seconds)
        logger.info("leader election: %s holds lease %s/%s", self.identity, self.namespace, self.name)

    async def try_acquire(self) -> bool:
        """One attempt: take a missing or expired Lease, or renew our own; False while another replica holds it."""
        started = time.monotonic()  # a standby cannot see this renewal before we send it
        lease = await self.kube.get(self.path)
        if lease is None:
            return await self._write(None, started)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime") or "")
        if record != self._seen:  # the holder renewed (or changed): its lease runs from now, by our clock
            self._seen, self._seen_at = record, time.monotonic()
        expired = time.monotonic() - self._seen_at > int(spec.get("leaseDurationSeconds") or self.lease_seconds)
        if holder and holder != self.identity and not expired:
            return False
        return await self._write(lease, started)

    async def keep(self) -> None:
        """Renew every ``retry_seconds``; return when the Lease is lost or was not renewed within the renew
        deadline, at that deadline even if a request hangs. Writes are fenced from then on; the caller must stop
        acting as well (a standby may take the Lease ``lease_seconds`` after our last renewal)."""
        while True:
            await asyncio.sleep(max(0.0, min(self.retry_seconds, self._leading_until - time.monotonic())))
            left = self._leading_until - time.monotonic()
            if left <= 0:
                logger.error("leader election: %s could not renew lease %s in time", self.identity, self.name)
                return
            try:
                if await asyncio.wait_for(self.try_acquire(), left):
                    continue
                self._leading_until = 0.0
                logger.error("leader election: %s lost lease %s to another replica", self.identity, self.name)
                return
            except Exception as error:  # noqa: BLE001 - an API outage or a cut-off attempt: retry until the deadline
                logger.warning("leader election: renewing lease %s failed: %r", self.name, error)

    async def release(self) -> None:
        """Give the Lease back (a graceful exit): standbys take it at their next attempt."""
        self._leading_until = 0.0  # we stop acting first
        lease = await self.kube.get(self.path)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        lease["spec"]["holderIdentity"] = ""
        try:
            await self.kube.replace(self.path, lease)
        except KubeError as error:  # it runs out by itself in lease_seconds
            logger.warning("leader election: releasing lease %s failed: %s", self.name, error)

    async def _write(self, lease: Optional[dict[str, Any]], started: float) -> bool:
        now = _now()
        spec: dict[str, Any] = dict((lease or {}).get("spec") or {})
        if spec.get("holderIdentity") != self.identity:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if lease is not None else 0)
        spec.update(holderIdentity=self.identity, leaseDurationSeconds=self.lease_seconds, renewTime=now)
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if lease is not None:
            metadata["resourceVersion"] = lease["metadata"]["resourceVersion"]
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}
        try:
            if lease is None:
                await self.kube.create(self.path.rsplit("/", 1)[0], body)
            else:
                await self.kube.replace(self.path, body)
        except KubeError as error:
            if error.status == 409:  # another replica wrote first
                return False
            raise
        self._seen, self._seen_at = (self.identity, now), time.monotonic()
        self._leading_until = started + self.renew_deadline
        return True


def fence_kopf_writes(fence: Callable[[], None]) -> None:
    """Make kopf's own writes (the resource's status, finalizer and progress annotations, Events) call ``fence``
    before each request, as ``KubeClient(fence=...)`` does for ours.

    kopf has no public hook for this. Every request it makes goes through ``kopf._cogs.clients.api.request``, which
    its get/post/patch/delete look up as a module global at each call, so wrapping that one function (once per
    process, before kopf starts) covers them all; if a kopf release moves it, this fails loudly at startup."""
    from kopf._cogs.clients import api  # kopf's private module (kopf>=1.45,<2 is pinned)

    original = api.request
    if getattr(original, "_pagoda_fenced", False):
        raise RuntimeError("kopf's writes are fenced already")

    async def request(method: str, url: str, **kwargs: Any) -> Any:
        if method.upper() != "GET":
            fence()
        return await original(method, url, **kwargs)

    request._pagoda_fenced = True  # type: ignore[attr-defined]
    api.request = request
