"""Which adapters the Ready pods have loaded: ``status.loraAdapters`` and the ``LoraAdaptersReady`` condition.

Each Ready pod is asked ``GET /lora_adapters`` (the engine's report: name, path, state loaded or failed, the error).
For each adapter of the spec, a pod counts as loaded when it lists the adapter under its name with the path the
ConfigMap gives it and state loaded, and as failed when that entry is in state failed. A pod that does not list it,
or lists it with another path, has not read the current adapter list yet (the kubelet refreshes the mounted
ConfigMap about a minute after a change): pending. A pod that does not answer counts neither way.

The condition, most pressing first: False/AdapterLoadFailed when a pod failed to load an adapter (which one, on how
many pods, the engine's error); False/AdapterPending while a pod that answered lacks one; Unknown/PodsNotAnswering
when every answer was complete but some Ready pod did not answer; Unknown/NoReadyPods without a Ready pod;
True/AllAdaptersLoaded otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp

from pagoda_operator.builders.lora import adapter_list
from pagoda_operator.conditions import Condition
from pagoda_operator.pods import is_ready, pod_url
from pagoda_operator.spec import ModelDeploymentSpec

FETCH_TIMEOUT_SECONDS = 2.0
CONDITION = "LoraAdaptersReady"


@dataclass(slots=True, frozen=True)
class PodAdapters:
    """One Ready pod's answer: its adapters by name (None when it did not answer)."""

    pod: str
    adapters: Optional[Mapping[str, Mapping[str, Any]]]


@dataclass(slots=True, frozen=True)
class LoraStatus:
    """``status.loraAdapters`` (one entry per spec adapter, in spec order) and the condition."""

    adapters: list[dict[str, Any]]
    condition: Condition


async def fetch_pod_adapters(
    session: aiohttp.ClientSession, pod: Mapping[str, Any], timeout: float = FETCH_TIMEOUT_SECONDS
) -> PodAdapters:
    """``GET /lora_adapters`` of one pod; any failure (refused, timeout, HTTP error, not the engine's JSON) is no
    answer."""
    name = str((pod.get("metadata") or {}).get("name", "?"))
    try:
        async with session.get(pod_url(pod, "/lora_adapters"), timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
            if reply.status != 200:
                return PodAdapters(name, None)
            body = await reply.json(content_type=None)
        entries = {str(item["name"]): item for item in body["data"] if isinstance(item, dict)}
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        return PodAdapters(name, None)
    return PodAdapters(name, entries)


async def observe_pod_adapters(session: aiohttp.ClientSession, pods: Sequence[Mapping[str, Any]]) -> list[PodAdapters]:
    """Every Ready pod's answer, asked concurrently, ordered by pod name (so the status is stable)."""
    ready = sorted((p for p in pods if is_ready(p)), key=lambda p: str((p.get("metadata") or {}).get("name")))
    return list(await asyncio.gather(*(fetch_pod_adapters(session, p) for p in ready)))


def _entry(name: str, path: str, reports: Sequence[PodAdapters]) -> tuple[dict[str, Any], int]:
    """The status entry of one adapter, and on how many answering pods it is still pending."""
    loaded = failed = pending = 0
    error: Optional[str] = None
    for report in reports:
        if report.adapters is None:
            continue
        item = report.adapters.get(name) or {}
        if not _same_source(item, path):
            pending += 1
        elif item.get("state") == "loaded":
            loaded += 1
        elif item.get("state") == "failed":
            failed += 1
            error = error or f"pod {report.pod}: {item.get('error') or 'no error given'}"
        else:
            pending += 1
    entry: dict[str, Any] = {"name": name, "loadedPods": loaded, "failedPods": failed}
    if error is not None:
        entry["message"] = error
    return entry, pending


def _same_source(item: Mapping[str, Any], path: str) -> bool:
    """Whether the pod serves ``name`` from ``path``: an engine with an API key tells callers without it (the
    operator reads no Secrets) only the sha256 of each adapter's path, never the path."""
    if "path" in item:
        return item["path"] == path
    return item.get("path_sha256") == hashlib.sha256(path.encode()).hexdigest()


def _naming_the_first(
    reason: str, entries: Sequence[dict[str, Any]], what: str, says: Callable[[dict[str, Any]], str]
) -> Condition:
    """False with ``reason``: what ``says`` of the first adapter of ``entries``, and how many more are ``what``."""
    first = entries[0]
    more = f" (and {len(entries) - 1} more {what})" if len(entries) > 1 else ""
    return Condition(CONDITION, False, reason, f"adapter {first['name']} {says(first)}{more}")


def lora_condition(entries: Sequence[dict[str, Any]], pending: Sequence[int], ready: int, answered: int) -> Condition:
    """The ``LoraAdaptersReady`` condition for the entries of ``lora_status`` (see the module docstring)."""
    failed = [e for e in entries if e["failedPods"]]
    if failed:
        return _naming_the_first(
            "AdapterLoadFailed",
            failed,
            "failed",
            lambda e: f"failed to load on {e['failedPods']} of {ready} ready pods ({e['message']})",
        )
    waiting = [e for e, count in zip(entries, pending) if count]
    if waiting:
        return _naming_the_first(
            "AdapterPending",
            waiting,
            "pending",
            lambda e: (
                f"is loaded on {e['loadedPods']} of {ready} ready pods; the others have not read the current "
                "adapter list yet"
            ),
        )
    if ready == 0:
        return Condition(CONDITION, None, "NoReadyPods", "no ready pod to load the adapters on")
    if answered < ready:
        message = f"{ready - answered} of {ready} ready pods did not answer GET /lora_adapters"
        return Condition(CONDITION, None, "PodsNotAnswering", message)
    return Condition(CONDITION, True, "AllAdaptersLoaded", f"{len(entries)} adapters loaded on {ready} ready pods")


def lora_status(spec: ModelDeploymentSpec, reports: Sequence[PodAdapters]) -> LoraStatus:
    """The adapter status from the Ready pods' answers (``reports``, one per Ready pod)."""
    counted = [_entry(item["name"], item["path"], reports) for item in adapter_list(spec)]
    entries = [entry for entry, _ in counted]
    answered = sum(1 for r in reports if r.adapters is not None)
    condition = lora_condition(entries, [pending for _, pending in counted], len(reports), answered)
    return LoraStatus(entries, condition)


async def observe_lora(
    session: Optional[aiohttp.ClientSession], spec: Optional[ModelDeploymentSpec], pods: Sequence[Mapping[str, Any]]
) -> Optional[LoraStatus]:
    """The adapter status of a valid spec with LoRA on (None otherwise, or without an HTTP session)."""
    if session is None or spec is None or not spec.lora_enabled:
        return None
    return lora_status(spec, await observe_pod_adapters(session, pods))
