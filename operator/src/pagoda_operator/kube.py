"""The operator's Kubernetes API client: ``kubernetes_asyncio`` with the credentials kopf logs in with.

Only what the reconciler needs: get, paginated list, watch, server-side apply (also as a dry run), merge patch and
delete of plain dicts; create and replace for the leader-election Lease. Children are created and changed only by
server-side apply (field manager ``pagoda-operator``, forced), so the operator owns exactly the fields it sets: hand
edits of them are undone and fields it stops setting are removed, while fields other managers own (an autoscaler's
replicas, ``kubectl set env``) are left alone.

Why ``kubernetes_asyncio`` (pinned in ``operator/pyproject.toml``): it is the official client's asyncio twin (same
``Configuration``/``ApiClient``, releases follow Kubernetes'), it runs on aiohttp, which kopf already brings, so the
image gains no second HTTP stack (lightkube brings httpx2, anyio, h2 and msgspec; kr8s httpx, anyio and
cryptography), and ``ApiClient.call_api`` takes any REST path, so custom resources, subresources (``/status``) and
Leases need no model classes and objects stay plain dicts. Its cost is size (about 26 MB of generated models on
disk, pure Python, 0.5 s to import once). What it lacks is a thin layer here, around ``call_api``, not new HTTP code:

- retries (``RetryPolicy``): 429 for every method, as the API server rejects it before running the request
  (Retry-After honoured); 500/502/503/504, timeouts and dropped connections only for GET, DELETE and PATCH, which
  can be replayed (an apply or a merge patch gives the same object twice; a replayed DELETE finds it gone, so
  ``delete`` may then say False); a connection that could not be opened, for every method (nothing was sent). POST
  and PUT are not replayed after a 5xx: a create that went through would fail as AlreadyExists, and the Lease's
  conditional PUT as a 409, which the elector would take for a lost Lease;
- pagination: ``list`` pages with ``limit``/``continue`` and starts over without paging when the continue token
  expired (410), as client-go's pager does;
- token refresh: a token file (the in-cluster service account token, which the kubelet rotates) is re-read when it
  changes and after a 401, which is then retried once (``kube_config.TokenFile``);
- fencing: ``fence``, when given, is called before every attempt of every write (anything but GET) and refuses
  it by raising; under leader election it is ``LeaseElector.fence``, so a replica past its renew deadline writes
  nothing (``leader``).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp
import kopf
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from pagoda_operator.constants import FIELD_MANAGER
from pagoda_operator.kube_config import SERVICE_ACCOUNT_TOKEN, KubeConfig
from pagoda_operator.version import __version__

logger = logging.getLogger(__name__)

_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ConfigMap": "configmaps",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "InferencePool": "inferencepools",
    "InferenceObjective": "inferenceobjectives",
    "ScaledObject": "scaledobjects",
}
DEFAULT_PAGE_SIZE = 500  # client-go's pager default
_AS_DICT = {200: "object", 201: "object", 202: "object"}  # "object": the library hands the decoded JSON back as is
_REPLAYABLE = frozenset({"GET", "DELETE", "PATCH"})
_RETRIED_5XX = frozenset({500, 502, 503, 504})
WATCH_TIMEOUT_S = 300  # the server ends a watch after this (timeoutSeconds); the watcher then resumes
_WATCH_SILENCE_S = WATCH_TIMEOUT_S + 60


class KubeError(Exception):
    """An API request that failed with an HTTP status other than the ones the caller expects."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def object_path(api_version: str, plural: str, namespace: Optional[str], name: Optional[str] = None) -> str:
    """The REST path of a collection (cluster-wide when ``namespace`` is None), or of one object in it."""
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


def path_of(obj: Mapping[str, Any]) -> str:
    """The REST path of a manifest built by the builders."""
    meta = obj["metadata"]
    return object_path(obj["apiVersion"], _PLURALS[obj["kind"]], meta["namespace"], meta["name"])


def selector_string(labels: Mapping[str, str]) -> str:
    """``{"a": "b", "c": "d"}`` as the API's ``labelSelector`` (``a=b,c=d``)."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how long to wait before retrying a failed request (see the module docstring for which)."""

    attempts: int = 6  # tries in all
    base_delay: float = 0.25  # seconds before the first retry; doubles each time
    max_delay: float = 8.0
    max_retry_after: float = 60.0  # a server asking for longer is asked again sooner

    def backoff(self, retry: int) -> float:
        """Exponential with jitter (half fixed, half random), so clients that failed together spread out."""
        ceiling = min(self.max_delay, self.base_delay * 2**retry)
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def retry_after(self, headers: Optional[Mapping[str, str]]) -> Optional[float]:
        """The Retry-After header in seconds (delta-seconds or an HTTP date), capped; None without one."""
        value = (headers or {}).get("Retry-After")
        if not value:
            return None
        try:
            seconds = float(value)
        except ValueError:
            try:
                seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError):
                return None
        return min(max(seconds, 0.0), self.max_retry_after)

    def delay(
        self,
        method: str,
        retry: int,
        status: Optional[int] = None,
        headers: Optional[Mapping[str, str]] = None,
        error: Optional[BaseException] = None,
    ) -> Optional[float]:
        """Seconds to wait before retry number ``retry`` (0-based), or None when the failure is final."""
        if retry + 1 >= self.attempts:
            return None
        if status == 429 or (status in _RETRIED_5XX and method in _REPLAYABLE):
            after = self.retry_after(headers)
            return self.backoff(retry) if after is None else after
        if isinstance(error, aiohttp.ClientConnectorError) or (error is not None and method in _REPLAYABLE):
            return self.backoff(retry)
        return None


class _Failed(Exception):
    """A non-2xx answer, before the retry policy decides whether it is final."""

    def __init__(self, status: int, headers: Optional[Mapping[str, str]], body: Any) -> None:
        super().__init__(status)
        self.status, self.headers = status, headers
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        self.message = payload.get("message", "") if isinstance(payload, dict) else str(body or "")


def login(settings: kopf.OperatorSettings) -> Optional[kopf.ConnectionInfo]:
    """kopf's own logins: the in-cluster service account, else the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``).

    The operator registers this as kopf's login handler too, so kopf and ``KubeClient`` act as one identity: with
    ``kubernetes_asyncio`` installed, kopf would otherwise log in through that library's loaders instead."""
    return _login(settings)[0]


def _login(settings: kopf.OperatorSettings) -> tuple[Optional[kopf.ConnectionInfo], Optional[str]]:
    """``login``, and the token file to re-read (the service account's) when that is what it used."""
    info = kopf.login_with_service_account(settings=settings)
    if info is not None:
        return info, SERVICE_ACCOUNT_TOKEN
    return kopf.login_with_kubeconfig(settings=settings), None


class KubeClient:
    """A ``kubernetes_asyncio`` API client bound to one API server; close it with ``close()``."""

    def __init__(
        self,
        info: kopf.ConnectionInfo,
        *,
        token_file: Optional[str] = None,
        retry: RetryPolicy = RetryPolicy(),
        timeout: float = 30.0,
        fence: Optional[Callable[[], None]] = None,
    ) -> None:
        """``token_file``: a bearer token file to re-read when it changes (overrides ``info.token``); ``fence``:
        called before each write attempt, raising to refuse it (see the module docstring)."""
        self._config = KubeConfig.from_connection_info(info, token_file)
        self._api = ApiClient(self._config.configuration)  # builds the SSL context from the files ...
        self._config.remove_files()  # ... so in-memory keys written for it need not stay on disk
        self._api.user_agent = f"pagoda-operator/{__version__}"
        self._retry = retry
        self._timeout = timeout
        self._fence = fence

    @classmethod
    def from_environment(
        cls, settings: kopf.OperatorSettings, fence: Optional[Callable[[], None]] = None
    ) -> KubeClient:
        """Logged in as ``login`` does; an in-cluster token is re-read as the kubelet rotates it."""
        info, token_file = _login(settings)
        if info is None:
            raise kopf.PermanentError("no Kubernetes credentials: neither a service account nor a kubeconfig")
        return cls(info, token_file=token_file, fence=fence)

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._api.close()

    async def _send(
        self, method: str, path: str, query: Sequence[tuple[str, str]], body: Any, content_type: str, stream: bool
    ) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        timeout: Any = self._timeout
        if stream:  # a watch: no total limit, but one silent for longer than the server's own limit is dead
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout, sock_read=_WATCH_SILENCE_S)
        try:
            result = await self._api.call_api(
                path,
                method,
                query_params=list(query),
                header_params=headers,
                body=body,
                response_types_map=_AS_DICT,
                auth_settings=self._config.auth_settings,
                _return_http_data_only=True,
                _preload_content=not stream,
                _request_timeout=timeout,
            )
        except ApiException as error:
            raise _Failed(error.status, error.headers, error.body) from None
        if stream and result.status >= 300:  # unread responses are not checked by the library
            text = await result.text()
            result.release()
            raise _Failed(result.status, result.headers, text)
        return result

    async def _call(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str = "application/json",
        stream: bool = False,
    ) -> Any:
        """One API request with the retries of ``RetryPolicy`` and a token re-read on a 401."""
        retry, reauthenticated = 0, False
        while True:
            if self._fence is not None and method != "GET":
                self._fence()  # at each attempt: a retry after the deadline is refused too
            try:
                return await self._send(method, path, query, body, content_type, stream)
            except _Failed as failure:
                token = self._config.token_file
                if failure.status == 401 and token is not None and not reauthenticated:
                    token.invalidate()  # rotated between our stat and the server's check: read it again, once
                    reauthenticated = True
                    continue
                delay = self._retry.delay(method, retry, status=failure.status, headers=failure.headers)
                if delay is None:
                    raise KubeError(failure.status, failure.message) from None
                reason: object = f"HTTP {failure.status}"
            except (aiohttp.ClientError, TimeoutError) as error:
                delay = self._retry.delay(method, retry, error=error)
                if delay is None and isinstance(error, aiohttp.ClientError):
                    raise
                if delay is None:  # callers handle aiohttp.ClientError; a bare timeout is one too
                    raise aiohttp.ServerTimeoutError(f"{method} {path} timed out") from error
                reason = repr(error)
            logger.debug("%s %s failed (%s); retry %d in %.2f s", method, path, reason, retry + 1, delay)
            retry += 1
            await asyncio.sleep(delay)

    async def get(self, path: str) -> Optional[dict[str, Any]]:
        """The object at ``path``, or None when it does not exist."""
        try:
            return await self._call("GET", path)
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def list(
        self, path: str, label_selector: Mapping[str, str], *, page_size: int = DEFAULT_PAGE_SIZE
    ) -> list[dict[str, Any]]:
        """Objects of a collection whose labels include ``label_selector`` (also filtered here, to be sure), read
        ``page_size`` at a time."""
        items, _ = await self.list_with_version(path, label_selector, page_size=page_size)
        return items

    async def list_with_version(
        self, path: str, label_selector: Mapping[str, str], *, page_size: int = DEFAULT_PAGE_SIZE
    ) -> tuple[list[dict[str, Any]], str]:
        """``list``, and the collection's resourceVersion (to watch from). All pages come from one snapshot."""
        query = [("labelSelector", selector_string(label_selector))]
        items: list[dict[str, Any]] = []
        version, token = "", ""
        while True:
            paging = [("limit", str(page_size)), *([("continue", token)] if token else [])]
            try:
                page = await self._call("GET", path, query=[*query, *paging])
            except KubeError as error:
                if error.status != 410 or not token:
                    raise
                logger.info("list %s: continue token expired; listing again without pages", path)
                page, items, version = await self._call("GET", path, query=query), [], ""
            meta = page.get("metadata") or {}
            items.extend(page.get("items") or [])
            version = version or meta.get("resourceVersion", "")
            token = meta.get("continue") or ""
            if not token:
                break
        wanted = label_selector.items()
        return [i for i in items if wanted <= ((i.get("metadata") or {}).get("labels") or {}).items()], version

    async def watch(
        self,
        path: str,
        label_selector: Mapping[str, str],
        resource_version: str,
        *,
        timeout_seconds: int = WATCH_TIMEOUT_S,
    ) -> AsyncIterator[dict[str, Any]]:
        """The events (``{"type", "object"}``, bookmarks included) of one watch request on a collection, from
        ``resource_version`` on, until the server ends it (after about ``timeout_seconds``). The server selects
        by label, so objects without them never reach this process. A 410 Gone (the version is too old) raises
        ``KubeError(410)``: list again and watch from the list's version."""
        query = [
            ("watch", "true"),
            ("labelSelector", selector_string(label_selector)),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),  # keeps our version fresh while nothing selected changes
            ("timeoutSeconds", str(timeout_seconds)),
        ]
        response = await self._call("GET", path, query=query, stream=True)
        try:
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise KubeError(int(status.get("code") or 500), str(status.get("message", "")))
                yield event
        finally:
            response.release()

    async def create(self, path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``obj`` to the collection at ``path`` (used for Leases, whose writes must be conditional)."""
        return await self._call("POST", path, query=[("fieldManager", FIELD_MANAGER)], body=dict(obj))

    async def replace(self, path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT ``obj`` at ``path``; a 409 when its ``metadata.resourceVersion`` is no longer the live one."""
        return await self._call("PUT", path, query=[("fieldManager", FIELD_MANAGER)], body=dict(obj))

    async def apply(
        self, obj: Mapping[str, Any], *, manager: str = FIELD_MANAGER, dry_run: bool = False
    ) -> dict[str, Any]:
        """Server-side apply of ``obj`` as ``manager``, creating it if missing (forced: the manager wins conflicts
        on the fields it sets). ``dry_run``: what the object would become, with nothing written."""
        query = [("fieldManager", manager), ("force", "true"), *([("dryRun", "All")] if dry_run else [])]
        # JSON is YAML, so the apply body goes out as JSON under the apply content type.
        return await self._call(
            "PATCH", path_of(obj), query=query, body=dict(obj), content_type="application/apply-patch+yaml"
        )

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (used for the owner's status)."""
        query = [("fieldManager", FIELD_MANAGER)]
        return await self._call(
            "PATCH", path, query=query, body=dict(patch), content_type="application/merge-patch+json"
        )

    async def delete(self, path: str) -> bool:
        """Delete the object at ``path``; False when it was already gone."""
        try:
            await self._call("DELETE", path, query=[("propagationPolicy", "Background")])
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True
