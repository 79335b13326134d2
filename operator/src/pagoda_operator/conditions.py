"""Status conditions: the ``Condition`` every status module builds, and how conditions are written into a status.

Below ``status``, ``lora_status`` and ``scale_status``, which all make conditions: ``status`` puts theirs next to
its own, so none of them may depend on another for the type.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(slots=True, frozen=True)
class Condition:
    """One status condition before timestamps are attached; ``status`` None is Unknown."""

    type: str
    status: Optional[bool]
    reason: str
    message: str


def find_condition(status: Mapping[str, Any], kind: str) -> Optional[Mapping[str, Any]]:
    """The condition of type ``kind`` as ``status`` (a live ``.status``) holds it, or None."""
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def render_conditions(
    conditions: Sequence[Condition],
    previous: Sequence[Mapping[str, Any]],
    generation: Optional[int],
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Conditions as status dicts; a condition keeps its lastTransitionTime while its status does not change."""
    before = {c.get("type"): c for c in previous}
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    rendered: list[dict[str, Any]] = []
    for condition in conditions:
        status = {True: "True", False: "False", None: "Unknown"}[condition.status]
        old = before.get(condition.type) or {}
        item: dict[str, Any] = {
            "type": condition.type,
            "status": status,
            "reason": condition.reason,
            "message": condition.message,
            "lastTransitionTime": old.get("lastTransitionTime", stamp) if old.get("status") == status else stamp,
        }
        if generation is not None:
            item["observedGeneration"] = generation
        rendered.append(item)
    return rendered
