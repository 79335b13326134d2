"""Demand for a model at zero ready pods, pure: the router's ``pagoda.dev/demand-at`` stamp and ``now`` -> fresh or not.

The router stamps ``status.demandAt`` (RFC 3339 UTC, ``2026-12-03T14:00:00Z``; through the status subresource, the
only write its RBAC allows) on a ModelDeployment while it holds requests for a model that has no ready pod (a person
may set the ``pagoda.dev/demand-at`` annotation instead), again at most every ``DEMAND_STAMP_INTERVAL_SECONDS`` while it keeps
holding. A stamp younger than ``DEMAND_TTL_SECONDS`` is demand: the built-in autoscaler then runs at least one
replica. The router never writes replicas; the autoscaler stays their only writer in builtin mode.

A stamp in the future (the router's clock ahead of the operator's) counts as fresh only within the same TTL, so a
stamp far in the future cannot pin a model up forever. An annotation that cannot be read is no demand: it is logged
at debug level and otherwise ignored, never an error that would stop the autoscaler's tick.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from typing import Any, Optional

from pagoda_operator.constants import DEMAND_ANNOTATION, DEMAND_STATUS_FIELD, DEMAND_TTL_SECONDS

logger = logging.getLogger("pagoda_operator.autoscaler")


def parse_stamp(value: Optional[str]) -> Optional[float]:
    """Seconds since the epoch of an RFC 3339 stamp (``Z`` or an offset; fractions allowed), None when absent or
    unreadable. A stamp without a zone is read as UTC, which is what the router writes."""
    if not value or not isinstance(value, str):
        return None
    text = value.strip()
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        logger.debug(f"ignoring the unreadable {DEMAND_ANNOTATION} annotation {value!r}")
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def format_stamp(seconds: float) -> str:
    """The stamp for ``seconds`` since the epoch, as the router writes it (whole seconds, UTC, ``Z``)."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_fresh(value: Optional[str], now: float, ttl: float = DEMAND_TTL_SECONDS) -> bool:
    """Whether the annotation ``value`` is demand at ``now``: a readable stamp less than ``ttl`` seconds old (or
    less than ``ttl`` seconds ahead of ``now``)."""
    stamp = parse_stamp(value)
    return stamp is not None and abs(now - stamp) < ttl


def has_demand(body: Mapping[str, Any], now: float, ttl: float = DEMAND_TTL_SECONDS) -> bool:
    """Whether a ModelDeployment ``body`` carries a fresh demand stamp at ``now``: the router's
    ``status.demandAt``, or the ``pagoda.dev/demand-at`` annotation a person may set."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    status = body.get("status") or {}
    return is_fresh(status.get(DEMAND_STATUS_FIELD), now, ttl) or is_fresh(annotations.get(DEMAND_ANNOTATION), now, ttl)
