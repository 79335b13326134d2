"""The scaling decision, pure: pod samples + remembered recommendations + spec -> desired replicas and why.

The raw recommendation follows the HPA's AverageValue rule on queue depth, ``ceil(sum of waiting requests over ready
pods / targetWaitingRequests)`` clamped to [minReplicas, maxReplicas], so ``builtin`` and ``hpa`` modes agree. The
stabilization follows the HPA's behaviors: scale up to the *lowest* recommendation of the scale-up window (a spike
must persist; window 0 reacts at once) and down to the *highest* of the scale-down window (slow scale-down).

Failure modes handled on purpose:
- a ready pod whose metrics cannot be read is *unknown*, never zero: its recommendation is recorded as at least the
  current replicas, which blocks any scale-down for the whole scale-down window;
- not-ready pods are left out of the sum, but they are part of ``current_replicas`` (capacity already ordered);
- while a scale-up is still converging (fewer ready pods than replicas), no further scale-up is ordered until the
  pods are ready or ``convergence_timeout`` passes: at most one scaling action in flight;
- the recommendation history lives in the resource's status (``to_status``/``from_status``), so an operator restart
  in the middle of a window continues it instead of starting over; without any stored history, a scale-down
  window starts now instead of scaling down at once.

The history holds change points: a recommendation is recorded when it differs from the one in force, and holds
until the next one is recorded. So a tick that recommends what the last one did changes no state, and the status
(which stores it) is not rewritten every tick. A window sees every recommendation in force at some instant of it;
a tick that could measure nothing records the current replicas (unknown is not zero), so a scale-down window
starts over once the pods can be measured again.

With ``minReplicas: 0`` (scale to and from zero):
- at zero replicas (or zero ready pods) a fresh demand stamp (``autoscaler.demand``: the router holds requests for
  the model) orders ``max(1, recommendation)`` at once, with no scale-up stabilization for the first replica
  (reason ``ScaleFromZero``); without demand a model at zero stays there, quietly;
- a tick recommends zero only when the model is idle: every ready pod measured, no request waiting *and* none
  running (an engine that does not report its running requests is unknown, not idle), and no fresh demand. Any
  other tick recommends at least one, so a model serving requests with an empty queue is never dropped. The
  scale-down window then makes zero wait until the model has been idle for the whole window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from pagoda_operator.spec import Autoscaling

# How long a scale-up may take to bring its pods to ready before another scale-up may be ordered anyway.
CONVERGENCE_TIMEOUT_SECONDS = 900.0


@dataclass(slots=True, frozen=True)
class EngineMetrics:
    """The gauges of one pod (``autoscaler.scrape``); ``running`` and ``kv_cache_usage`` may be missing in older
    engines."""

    waiting: float
    running: Optional[float] = None
    kv_cache_usage: Optional[float] = None


@dataclass(slots=True, frozen=True)
class PodSample:
    """One engine pod at one instant; ``metrics`` is None when they could not be read (unknown, not zero)."""

    name: str
    ready: bool
    metrics: Optional[EngineMetrics] = None


@dataclass(slots=True, frozen=True)
class Recommendation:
    """A clamped raw recommendation and when it was made (seconds since the epoch)."""

    time: float
    replicas: int


@dataclass(slots=True, frozen=True)
class AutoscalerState:
    """What must survive an operator restart; stored in the resource status under ``autoscaler``."""

    recommendations: tuple[Recommendation, ...] = ()
    last_scale_time: Optional[float] = None
    last_scale_up_time: Optional[float] = None


@dataclass(slots=True, frozen=True)
class DecisionMetrics:
    """The observed values behind a decision (sums over ready pods with known metrics; kv usage is the mean)."""

    waiting: float
    running: float
    kv_cache_usage: Optional[float]
    pods_ready: int
    pods_unknown: int


@dataclass(slots=True, frozen=True)
class Decision:
    """The replicas to run, a one-word reason, the facts behind it and the state to store."""

    desired: int
    reason: str
    metrics: DecisionMetrics
    state: AutoscalerState = field(default_factory=AutoscalerState)
    raw: Optional[int] = None  # this tick's clamped recommendation, None when nothing could be measured


def _metrics(samples: Sequence[PodSample]) -> DecisionMetrics:
    ready = [s for s in samples if s.ready]
    known = [s.metrics for s in ready if s.metrics is not None]
    kv = [m.kv_cache_usage for m in known if m.kv_cache_usage is not None]
    return DecisionMetrics(
        waiting=sum(m.waiting for m in known),
        running=sum(m.running or 0.0 for m in known),
        kv_cache_usage=sum(kv) / len(kv) if kv else None,
        pods_ready=len(ready),
        pods_unknown=len(ready) - len(known),
    )


def _clamp(value: int, spec: Autoscaling) -> int:
    return max(spec.min_replicas, min(spec.max_replicas, value))


def _in_force_since(history: Sequence[Recommendation], start: float) -> list[Recommendation]:
    """The recommendations in force at some instant after ``start``: each holds until the next one's time."""
    ends = [r.time for r in history[1:]] + [math.inf]
    return [r for r, end in zip(history, ends) if end > start]


def _record(history: list[Recommendation], now: float, replicas: int) -> None:
    """Append a change point, unless ``replicas`` is the recommendation already in force."""
    if not history or history[-1].replicas != replicas:
        history.append(Recommendation(now, replicas))


def _stabilized(history: Sequence[Recommendation], spec: Autoscaling, current: int, now: float) -> int:
    up = [r.replicas for r in _in_force_since(history, now - spec.scale_up_stabilization_seconds)]
    down = [r.replicas for r in _in_force_since(history, now - spec.scale_down_stabilization_seconds)]
    up_limit, down_limit = min(up), max(down)
    if current < up_limit:
        return up_limit
    if current > down_limit:
        return down_limit
    return current


def _idle(samples: Sequence[PodSample], metrics: DecisionMetrics) -> bool:
    """Whether this tick measured a model doing nothing: ready pods, all known, none waiting or running."""
    known = [s.metrics for s in samples if s.ready and s.metrics is not None]
    running_known = all(m.running is not None for m in known)
    return bool(known) and not metrics.pods_unknown and running_known and metrics.waiting == 0 and metrics.running == 0


def _raw(samples: Sequence[PodSample], metrics: DecisionMetrics, spec: Autoscaling, demand: bool) -> int:
    """This tick's clamped recommendation from the queue depth; with ``minReplicas: 0`` zero only when idle."""
    raw = _clamp(math.ceil(metrics.waiting / spec.target_waiting_requests), spec)
    if spec.min_replicas == 0 and (demand or not _idle(samples, metrics)):
        raw = max(raw, 1)  # busy with an empty queue, or wanted: never zero
    return raw


def decide(
    samples: Sequence[PodSample],
    state: AutoscalerState,
    spec: Autoscaling,
    current_replicas: int,
    now: float,
    convergence_timeout: float = CONVERGENCE_TIMEOUT_SECONDS,
    *,
    demand: bool = False,
) -> Decision:
    """Desired replicas for the pods observed now, given the remembered recommendations and whether the router
    holds requests for the model (``demand``: a fresh ``pagoda.dev/demand-at`` stamp; see the module doc)."""
    metrics = _metrics(samples)
    keep = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
    history = _in_force_since(state.recommendations, now - keep)
    if metrics.pods_ready == metrics.pods_unknown:
        # Nothing measurable: only the min/max clamp (and demand for a first replica) may act, never a metric.
        desired = _clamp(current_replicas, spec)
        reason = "NoReadyPods" if metrics.pods_ready == 0 else "MetricsUnknown"
        reason = reason if desired == current_replicas else "Clamped"
        if desired == 0 and current_replicas == 0 and not demand:
            reason = "ScaledToZero"
        raw = None
    else:
        raw = _raw(samples, metrics, spec, demand)
        if metrics.pods_unknown:
            raw = max(raw, _clamp(current_replicas, spec))  # unknown is not zero: no scale-down on missing data
        if not history and raw < current_replicas:
            # No remembered window (a new resource, or state lost): start one rather than scaling down at once.
            history.append(Recommendation(now, _clamp(current_replicas, spec)))
        _record(history, now, raw)
        desired = _clamp(_stabilized(history, spec, current_replicas, now), spec)
        reason = _reason(desired, current_replicas, raw, metrics)
        converging = state.last_scale_up_time is not None and now - state.last_scale_up_time < convergence_timeout
        if desired > current_replicas and converging and sum(s.ready for s in samples) < current_replicas:
            desired, reason = current_replicas, "ScaleUpInProgress"
    if demand and current_replicas == 0:
        # The router holds requests and nothing can serve them: the first replica now, past any window. (With
        # replicas ordered but none ready yet, both branches above already keep at least one.)
        desired, reason = max(desired, raw or 0, 1), "ScaleFromZero"
    if raw is None:
        _record(history, now, desired)
    new_state = AutoscalerState(tuple(history), state.last_scale_time, state.last_scale_up_time)
    return _finish(desired, reason, metrics, new_state, raw, now, current_replicas)


def _reason(desired: int, current: int, raw: int, metrics: DecisionMetrics) -> str:
    if desired > current:
        return "ScaleUp"
    if desired < current:
        return "ScaleToZero" if desired == 0 else "ScaleDown"
    if desired == 0:
        return "ScaledToZero"
    if metrics.pods_unknown and raw == current:
        return "MetricsUnknown"
    return "Stable" if raw == current else "Stabilizing"


def _finish(
    desired: int,
    reason: str,
    metrics: DecisionMetrics,
    state: AutoscalerState,
    raw: Optional[int],
    now: float,
    current: Optional[int] = None,
) -> Decision:
    if current is not None and desired != current:
        up_time = now if desired > current else state.last_scale_up_time
        state = AutoscalerState(state.recommendations, now, up_time)
    return Decision(desired=desired, reason=reason, metrics=metrics, state=state, raw=raw)


def to_status(state: AutoscalerState) -> dict[str, Any]:
    """The state as a JSON-friendly dict for ``status.autoscaler``."""
    return {
        "recommendations": [{"time": r.time, "replicas": r.replicas} for r in state.recommendations],
        "lastScaleTime": state.last_scale_time,
        "lastScaleUpTime": state.last_scale_up_time,
    }


def from_status(raw: Optional[Mapping[str, Any]]) -> AutoscalerState:
    """The state stored by ``to_status``; an absent or damaged entry starts empty rather than failing."""
    if not raw:
        return AutoscalerState()
    try:
        recommendations = tuple(
            Recommendation(float(r["time"]), int(r["replicas"])) for r in raw.get("recommendations") or ()
        )
        last = raw.get("lastScaleTime")
        last_up = raw.get("lastScaleUpTime")
        return AutoscalerState(
            recommendations, None if last is None else float(last), None if last_up is None else float(last_up)
        )
    except (KeyError, TypeError, ValueError):
        return AutoscalerState()
