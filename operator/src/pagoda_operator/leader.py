"""Leader election on a ``coordination.k8s.io/v1`` Lease, as Kubernetes' own controllers do it.

One replica holds the Lease and runs the operator; the others stand by and take it over once the holder has not
renewed it for ``lease_seconds``. Expiry is judged by when this replica last saw the Lease change (its own
monotonic clock), never by comparing another node's timestamps with ours, so clock skew between nodes cannot hand
the Lease to two replicas. Writes carry the resourceVersion they read: of two standbys racing for an expired Lease
one gets a 409 and keeps waiting.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from pagoda_operator.kube import KubeClient, KubeError, object_path

logger = logging.getLogger(__name__)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(slots=True)
class LeaseElector:
    """Acquire, then keep, the Lease ``namespace/name`` for ``identity``."""

    kube: KubeClient
    namespace: str
    name: str
    identity: str
    lease_seconds: int = 10
    retry_seconds: float = 2.0
    _seen: Optional[tuple[str, str]] = None  # (holder, renewTime) last observed
    _seen_at: float = 0.0  # monotonic time it was observed (or changed)

    @property
    def path(self) -> str:
        return object_path("coordination.k8s.io/v1", "leases", self.namespace, self.name)

    async def acquire(self) -> None:
        """Return once this replica holds the Lease (standing by meanwhile)."""
        while not await self.try_acquire():
            await asyncio.sleep(self.retry_seconds)
        logger.info("leader election: %s holds lease %s/%s", self.identity, self.namespace, self.name)

    async def try_acquire(self) -> bool:
        """One attempt: take a missing or expired Lease, or renew our own; False while another replica holds it."""
        lease = await self.kube.get(self.path)
        if lease is None:
            return await self._write(None)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime") or "")
        if record != self._seen:  # the holder renewed (or changed): its lease runs from now, by our clock
            self._seen, self._seen_at = record, time.monotonic()
        expired = time.monotonic() - self._seen_at > int(spec.get("leaseDurationSeconds") or self.lease_seconds)
        if holder and holder != self.identity and not expired:
            return False
        return await self._write(lease)

    async def keep(self) -> None:
        """Renew every ``retry_seconds``; return when the Lease could not be renewed for ``lease_seconds`` (another
        replica may hold it by then: the caller must stop acting at once)."""
        last_renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.retry_seconds)
            try:
                if await self.try_acquire():
                    last_renewed = time.monotonic()
                    continue
                logger.error("leader election: %s lost lease %s to another replica", self.identity, self.name)
                return
            except Exception as error:  # noqa: BLE001 - an API outage: keep trying until the lease runs out
                logger.warning("leader election: renewing lease %s failed: %s", self.name, error)
            if time.monotonic() - last_renewed > self.lease_seconds:
                logger.error("leader election: %s could not renew lease %s in time", self.identity, self.name)
                return

    async def release(self) -> None:
        """Give the Lease back (a graceful exit): standbys take it at their next attempt."""
        lease = await self.kube.get(self.path)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        lease["spec"]["holderIdentity"] = ""
        try:
            await self.kube.replace(self.path, lease)
        except KubeError as error:  # it runs out by itself in lease_seconds
            logger.warning("leader election: releasing lease %s failed: %s", self.name, error)

    async def _write(self, lease: Optional[dict[str, Any]]) -> bool:
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
        return True
