"""A small asynchronous Kubernetes API client on aiohttp, with the credentials kopf logs in with.

Only what the reconciler needs: get, list, server-side apply (also as a dry run), merge patch and delete of plain
dicts; create and replace for the leader-election Lease. Children are created and changed only by server-side apply (field manager ``pagoda-operator``, forced), so
the operator owns exactly the fields it sets: hand edits of them are undone and fields it stops setting are
removed, while fields other managers own (an autoscaler's replicas, ``kubectl set env``) are left alone.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from typing import Any, Optional

import aiohttp
import kopf

from pagoda_operator.constants import FIELD_MANAGER

_SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ConfigMap": "configmaps",
}


class KubeError(Exception):
    """An API request that failed with an HTTP status other than the ones the caller expects."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def object_path(api_version: str, plural: str, namespace: str, name: Optional[str] = None) -> str:
    """The REST path of a namespaced collection, or of one object in it when ``name`` is given."""
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def path_of(obj: Mapping[str, Any]) -> str:
    """The REST path of a manifest built by the builders."""
    meta = obj["metadata"]
    return object_path(obj["apiVersion"], _PLURALS[obj["kind"]], meta["namespace"], meta["name"])


class KubeClient:
    """An aiohttp session bound to one API server; close it with ``close()``."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self._server = info.server.rstrip("/")
        self._headers = info.as_http_headers()
        self._ssl: Optional[ssl.SSLContext] = info.as_ssl_context() if self._server.startswith("https") else None
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    @classmethod
    def from_environment(cls, settings: kopf.OperatorSettings) -> KubeClient:
        """In-cluster service account first, then the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``)."""
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
        if info is None:
            raise kopf.PermanentError("no Kubernetes credentials: neither a service account nor a kubeconfig")
        return cls(info)

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._session.close()

    def _auth_headers(self) -> dict[str, str]:
        # Projected service account tokens rotate: re-read the file rather than keeping the first token forever.
        if os.path.exists(_SERVICE_ACCOUNT_TOKEN) and self._server == "https://kubernetes.default.svc":
            with open(_SERVICE_ACCOUNT_TOKEN, encoding="utf-8") as f:
                return {"Authorization": f"Bearer {f.read().strip()}"}
        return dict(self._headers)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Optional[dict[str, str]] = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        headers = {**self._auth_headers(), "Accept": "application/json", "Content-Type": content_type}
        data = None if body is None else json.dumps(body)
        async with self._session.request(
            method, self._server + path, data=data, params=params, headers=headers, ssl=self._ssl
        ) as response:
            text = await response.text()
            payload = json.loads(text) if text else None
            return response.status, payload

    @staticmethod
    def _check(status: int, payload: Any, *allowed: int) -> None:
        if status >= 400 and status not in allowed:
            message = payload.get("message", "") if isinstance(payload, dict) else str(payload)
            raise KubeError(status, message)

    async def get(self, path: str) -> Optional[dict[str, Any]]:
        """The object at ``path``, or None when it does not exist."""
        status, payload = await self._request("GET", path)
        self._check(status, payload, 404)
        return None if status == 404 else payload

    async def list(self, path: str, label_selector: Mapping[str, str]) -> list[dict[str, Any]]:
        """Objects of a collection whose labels include ``label_selector`` (also filtered here, to be sure)."""
        selector = ",".join(f"{k}={v}" for k, v in label_selector.items())
        status, payload = await self._request("GET", path, params={"labelSelector": selector})
        self._check(status, payload)
        items = payload.get("items") or []
        return [i for i in items if label_selector.items() <= ((i.get("metadata") or {}).get("labels") or {}).items()]

    async def create(self, path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``obj`` to the collection at ``path`` (used for Leases, whose writes must be conditional)."""
        status, payload = await self._request("POST", path, body=obj, params={"fieldManager": FIELD_MANAGER})
        self._check(status, payload)
        return payload

    async def replace(self, path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT ``obj`` at ``path``; a 409 when its ``metadata.resourceVersion`` is no longer the live one."""
        status, payload = await self._request("PUT", path, body=obj, params={"fieldManager": FIELD_MANAGER})
        self._check(status, payload)
        return payload

    async def apply(
        self, obj: Mapping[str, Any], *, manager: str = FIELD_MANAGER, dry_run: bool = False
    ) -> dict[str, Any]:
        """Server-side apply of ``obj`` as ``manager``, creating it if missing (forced: the manager wins conflicts
        on the fields it sets). ``dry_run``: what the object would become, with nothing written."""
        params = {"fieldManager": manager, "force": "true"}
        if dry_run:
            params["dryRun"] = "All"
        status, payload = await self._request(
            "PATCH", path_of(obj), body=obj, params=params, content_type="application/apply-patch+yaml"
        )
        self._check(status, payload)
        return payload

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (used for the owner's status)."""
        status, payload = await self._request(
            "PATCH",
            path,
            body=patch,
            params={"fieldManager": FIELD_MANAGER},
            content_type="application/merge-patch+json",
        )
        self._check(status, payload)
        return payload

    async def delete(self, path: str) -> bool:
        """Delete the object at ``path``; False when it was already gone."""
        status, payload = await self._request("DELETE", path, params={"propagationPolicy": "Background"})
        self._check(status, payload, 404)
        return status != 404
