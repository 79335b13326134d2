"""Kubernetes discovery: the router's model table from ModelDeployments and their ready pods.

ModelDeployments (``pagoda.dev/v1alpha1``) are listed and watched in each namespace given (or cluster-wide); for
each one, its pods are listed and watched by its ``status.selector``. A model is routable under its
``status.servedModelName`` (set by the operator; a ModelDeployment without one is not routable yet) and under each
``spec.loraAdapters[].name``; its endpoints are its pods that ``pods.is_ready`` calls ready, at ``pods.pod_url``, with
their KV events addresses when the engine container declares the ``kv-events`` / ``kv-replay`` ports. A watch that
ends is resumed; one refused with 410 Gone, or that fails, is started over from a fresh list (with backoff).

Login is the operator's: the in-cluster service account, else the kubeconfig (``$KUBECONFIG`` or
``~/.kube/config``); ``--kubeconfig FILE`` names the kubeconfig to use instead, ahead of a service account.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import random
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Optional

import kopf

from pagoda_operator.constants import (
    API_VERSION,
    DEMAND_STATUS_FIELD,
    KV_EVENTS_PORT_NAME,
    KV_EVENTS_REPLAY_PORT_NAME,
    PLURAL,
)
from pagoda_operator.kube import KubeClient, KubeError, object_path
from pagoda_operator.pods import is_ready, pod_url
from pagoda_operator.router.endpoints import Endpoint
from pagoda_operator.router.static_models import Model, ModelTable

logger = logging.getLogger(__name__)

_BACKOFF_MAX = 30.0


def connect(kubeconfig: Optional[str] = None) -> KubeClient:
    """A client logged in as the operator logs in, or with the kubeconfig file ``kubeconfig`` when given."""
    settings = kopf.OperatorSettings()
    if kubeconfig is None:
        return KubeClient.from_environment(settings)
    with _environment("KUBECONFIG", kubeconfig):
        info = kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise ValueError(f"no usable credentials in kubeconfig {kubeconfig}")
    return KubeClient(info)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the block (kopf's kubeconfig login reads only ``$KUBECONFIG``)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def parse_selector(selector: str) -> dict[str, str]:
    """``a=b,c=d`` (the equality-based label selector the operator writes to ``status.selector``) as a dict."""
    labels = {}
    for part in filter(None, (p.strip() for p in selector.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise ValueError(f"unsupported label selector term {part!r}")
        labels[name.strip()] = value.strip().lstrip("=")  # "a==b" is "a=b"
    return labels


def pod_endpoint(pod: Mapping[str, Any], kv_events: bool) -> Endpoint:
    """The endpoint of a ready pod, with its KV events addresses when wanted and declared."""
    meta, ip = pod.get("metadata") or {}, pod["status"]["podIP"]
    ports: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") and port.get("containerPort"):
                ports[port["name"]] = int(port["containerPort"])
    events = ports.get(KV_EVENTS_PORT_NAME) if kv_events else None
    replay = ports.get(KV_EVENTS_REPLAY_PORT_NAME) if events else None
    return Endpoint(
        key=f"{meta.get('namespace')}/{meta.get('name')}",
        url=pod_url(pod, ""),
        kv_events=f"tcp://{ip}:{events}" if events else None,
        kv_replay=f"tcp://{ip}:{replay}" if replay else None,
    )


def model_of(md: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], kv_events: bool) -> Optional[Model]:
    """The routable model of a ModelDeployment and its pods; None while it has no served model name."""
    meta, spec, status = md.get("metadata") or {}, md.get("spec") or {}, md.get("status") or {}
    name = status.get("servedModelName")
    if not name:
        return None
    adapters = tuple(a["name"] for a in spec.get("loraAdapters") or [] if isinstance(a, dict) and a.get("name"))
    ready = sorted((p for p in pods if is_ready(p)), key=lambda p: p["metadata"]["name"])
    created = meta.get("creationTimestamp")
    stamp = int(datetime.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()) if created else 0
    return Model(
        name=name,
        endpoints=tuple(pod_endpoint(p, kv_events) for p in ready),
        adapters=adapters,
        namespace=meta.get("namespace"),
        deployment=meta.get("name"),
        created=stamp,
    )


def utc_stamp(now: Optional[datetime.datetime] = None) -> str:
    """RFC 3339 UTC with seconds, e.g. ``2026-12-03T14:00:00Z``."""
    now = now or datetime.datetime.now(datetime.UTC)
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def watch_collection(
    kube: KubeClient,
    path: str,
    labels: Mapping[str, str],
    on_list: Callable[[list[dict[str, Any]]], None],
    on_event: Callable[[str, dict[str, Any]], None],
) -> None:
    """List then watch ``path`` forever: ``on_list(items)`` after each (re)list, ``on_event(type, object)`` per
    change. Resumes a watch the server ended; lists again after 410 Gone or a failure (with jittered backoff)."""
    failures = 0
    while True:
        try:
            items, version = await kube.list_with_version(path, labels)
            on_list(items)
            failures = 0
            while True:
                async for event in kube.watch(path, labels, version):
                    obj = event.get("object") or {}
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        on_event(event["type"], obj)
        except asyncio.CancelledError:
            raise
        except KubeError as error:
            if error.status != 410:
                failures += 1
                logger.warning("watch of %s failed: %s", path, error)
        except Exception as error:  # dropped connections, timeouts: list again after a pause
            failures += 1
            logger.warning("watch of %s failed: %r", path, error)
        if failures:
            ceiling = min(_BACKOFF_MAX, 0.5 * 2 ** min(failures, 8))
            await asyncio.sleep(ceiling / 2 + random.uniform(0, ceiling / 2))


class _Deployment:
    """One ModelDeployment being followed: the object, its pods, and the task watching them."""

    def __init__(self, md: dict[str, Any]) -> None:
        self.md = md
        self.pods: dict[str, dict[str, Any]] = {}
        self.selector: Optional[str] = None
        self.task: Optional[asyncio.Task[None]] = None


class KubeDiscovery:
    """Keeps a ``ModelTable`` equal to the routable ModelDeployments of ``namespaces`` (None: every namespace)."""

    def __init__(
        self, kube: KubeClient, table: ModelTable, namespaces: Optional[Sequence[str]], kv_events: bool = True
    ) -> None:
        self.kube = kube
        self.table = table
        self.namespaces = list(namespaces) if namespaces else None
        self.kv_events = kv_events
        self._followed: dict[str, _Deployment] = {}

    async def run(self) -> None:
        """Follow every namespace until cancelled."""
        scopes: Sequence[Optional[str]] = self.namespaces or [None]
        watches = [self._watch_deployments(ns) for ns in scopes]
        try:
            await asyncio.gather(*watches)
        finally:
            for followed in self._followed.values():
                if followed.task is not None:
                    followed.task.cancel()

    def _watch_deployments(self, namespace: Optional[str]) -> Awaitable[None]:
        path = object_path(API_VERSION, PLURAL, namespace)

        def on_list(items: list[dict[str, Any]]) -> None:
            seen = {_key(md) for md in items}
            for key in [k for k in self._followed if _in_scope(k, namespace) and k not in seen]:
                self._forget(key)
            for md in items:
                self._update(md)

        def on_event(kind: str, md: dict[str, Any]) -> None:
            self._forget(_key(md)) if kind == "DELETED" else self._update(md)

        return watch_collection(self.kube, path, {}, on_list, on_event)

    def _forget(self, key: str) -> None:
        followed = self._followed.pop(key, None)
        if followed is not None and followed.task is not None:
            followed.task.cancel()
        self.table.remove(key)

    def _update(self, md: dict[str, Any]) -> None:
        key = _key(md)
        followed = self._followed.setdefault(key, _Deployment(md))
        followed.md = md
        selector = (md.get("status") or {}).get("selector") or None
        if selector != followed.selector:
            if followed.task is not None:
                followed.task.cancel()
            followed.selector, followed.pods, followed.task = selector, {}, None
            if selector:
                followed.task = asyncio.create_task(self._watch_pods(key, followed, selector))
        self._publish(key)

    def _publish(self, key: str) -> None:
        followed = self._followed.get(key)
        if followed is None:
            return
        model = model_of(followed.md, list(followed.pods.values()), self.kv_events)
        if model is None:
            self.table.remove(key)
        else:
            self.table.set(key, model)

    async def _watch_pods(self, key: str, followed: _Deployment, selector: str) -> None:
        try:
            labels = parse_selector(selector)
        except ValueError as error:
            logger.warning("%s: %s; its pods are not followed", key, error)
            return
        path = object_path("v1", "pods", key.split("/", 1)[0])

        def on_list(items: list[dict[str, Any]]) -> None:
            followed.pods = {p["metadata"]["name"]: p for p in items}
            self._publish(key)

        def on_event(kind: str, pod: dict[str, Any]) -> None:
            name = pod["metadata"]["name"]
            if kind == "DELETED":
                followed.pods.pop(name, None)
            else:
                followed.pods[name] = pod
            self._publish(key)

        await watch_collection(self.kube, path, labels, on_list, on_event)

    async def stamp_demand(self, key: str) -> None:
        """Record demand for the ModelDeployment ``key``: ``status.demandAt`` set to now, through the status
        subresource (all the router may write; replicas stay the operator's)."""
        namespace, name = key.split("/", 1)
        patch = {"status": {DEMAND_STATUS_FIELD: utc_stamp()}}
        await self.kube.merge_patch(object_path(API_VERSION, PLURAL, namespace, name) + "/status", patch)
        logger.debug("stamped demand on %s", key)


def _key(md: Mapping[str, Any]) -> str:
    meta = md.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def _in_scope(key: str, namespace: Optional[str]) -> bool:
    return namespace is None or key.startswith(namespace + "/")
