"""The built-in autoscaler's decision, table-driven: each case is a sequence of ticks (time, pods, replicas)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import pytest

from pagoda_operator.autoscaler.algorithm import (
    AutoscalerState,
    EngineMetrics,
    PodSample,
    Recommendation,
    decide,
    from_status,
    to_status,
)
from pagoda_operator.autoscaler.loop import builtin_enabled
from pagoda_operator.autoscaler.scrape import parse_metrics
from pagoda_operator.spec import Autoscaling

SPEC = Autoscaling(
    enabled=True,
    mode="builtin",
    min_replicas=1,
    max_replicas=6,
    target_waiting_requests=4,
    scale_up_stabilization_seconds=0,
    scale_down_stabilization_seconds=60,
)


def pods(*waiting: Optional[float], not_ready: int = 0) -> list[PodSample]:
    """Ready pods with these waiting counts (None: metrics unreadable), then ``not_ready`` starting pods."""
    ready = [PodSample(f"p{i}", True, None if w is None else EngineMetrics(w, 1.0, 0.5)) for i, w in enumerate(waiting)]
    return ready + [PodSample(f"s{i}", False) for i in range(not_ready)]


@dataclass(frozen=True)
class Tick:
    time: float
    pods: list[PodSample]
    expected: int
    reason: Optional[str] = None


def run(ticks: list[Tick], spec: Autoscaling = SPEC, replicas: int = 1, state: Optional[AutoscalerState] = None):
    """Feed the ticks in order, applying each decision as the Deployment would; assert every expectation."""
    state = state or AutoscalerState()
    for tick in ticks:
        decision = decide(tick.pods, state, spec, replicas, tick.time)
        assert decision.desired == tick.expected, (tick, decision)
        if tick.reason is not None:
            assert decision.reason == tick.reason, (tick, decision)
        state, replicas = decision.state, decision.desired
    return state, replicas


CASES = {
    "burst scales up at once with a zero scale-up window": (
        SPEC,
        1,
        [Tick(0, pods(0), 1, "Stable"), Tick(15, pods(17), 5, "ScaleUp"), Tick(30, pods(4, 3, 0, 0, 1), 5)],
    ),
    "burst is clamped to maxReplicas": (SPEC, 1, [Tick(0, pods(100), 6, "ScaleUp")]),
    "idle is clamped to minReplicas after the scale-down window": (
        replace(SPEC, min_replicas=2),
        3,
        [Tick(0, pods(0, 0, 0), 3, "Stabilizing"), Tick(59, pods(0, 0, 0), 3), Tick(61, pods(0, 0, 0), 2, "ScaleDown")],
    ),
    "replicas below minReplicas are raised even without metrics": (
        replace(SPEC, min_replicas=2),
        1,
        [Tick(0, pods(None), 2, "Clamped")],
    ),
    "scale-down waits for the whole window, then goes to the window's maximum": (
        SPEC,
        4,
        [
            Tick(0, pods(16, 0, 0, 0), 4, "Stable"),
            Tick(30, pods(4, 0, 0, 0), 4, "Stabilizing"),  # recommends 1, but 4 is in the window
            Tick(61, pods(4, 0, 0, 0), 4, "Stabilizing"),  # the 4 held until t=30: still in the window
            Tick(91, pods(4, 0, 0, 0), 1, "ScaleDown"),  # the 4 aged out; the window's max is 1
        ],
    ),
    "flapping load does not flap the replicas": (
        SPEC,
        1,
        [
            Tick(0, pods(12), 3, "ScaleUp"),
            Tick(15, pods(0, 0, 0), 3),
            Tick(30, pods(12, 0, 0), 3),
            Tick(45, pods(0, 0, 0), 3),
            Tick(60, pods(9, 3, 0), 3),
            Tick(75, pods(0, 0, 0), 3),
            Tick(121, pods(0, 0, 0), 3),  # the last spike held from t=60 until t=75
            Tick(136, pods(0, 0, 0), 1, "ScaleDown"),  # a calm window after it
        ],
    ),
    "a scale-up window ignores a spike that does not persist": (
        replace(SPEC, scale_up_stabilization_seconds=30),
        1,
        [
            Tick(0, pods(0), 1),
            Tick(15, pods(20), 1, "Stabilizing"),  # the window still holds a 1
            Tick(31, pods(1), 1),  # spike gone
            Tick(45, pods(20), 1),
            Tick(74, pods(20), 1),  # t=31's 1, in force until t=45, is still in the window
            Tick(76, pods(20), 5, "ScaleUp"),  # persisted for the whole window
        ],
    ),
    "a pod with unreadable metrics blocks scale-down (unknown is not zero)": (
        SPEC,
        3,
        [
            Tick(0, pods(0, None, 0), 3, "MetricsUnknown"),
            Tick(100, pods(0, None, 0), 3, "MetricsUnknown"),
            Tick(200, pods(None, None, None), 3, "MetricsUnknown"),
        ],
    ),
    "a pod with unreadable metrics does not prevent a scale-up from the others": (
        SPEC,
        2,
        [Tick(0, pods(20, None), 5, "ScaleUp")],
    ),
    "the unknown pod's hold lasts a full scale-down window after it comes back": (
        SPEC,
        3,
        [
            Tick(0, pods(0, None, 0), 3),
            Tick(30, pods(0, 0, 0), 3),  # back
            Tick(89, pods(0, 0, 0), 3),
            Tick(91, pods(0, 0, 0), 1, "ScaleDown"),
        ],
    ),
    "not-ready pods are left out of the sum but count as capacity already ordered": (
        SPEC,
        3,
        [Tick(0, pods(12, not_ready=2), 3, "Stable")],
    ),
    "no ready pods: hold": (SPEC, 3, [Tick(0, pods(not_ready=3), 3, "NoReadyPods")]),
    "at most one scale-up in flight until its pods are ready": (
        SPEC,
        1,
        [
            Tick(0, pods(8), 2, "ScaleUp"),
            Tick(15, pods(20, not_ready=1), 2, "ScaleUpInProgress"),
            Tick(30, pods(10, 10), 5, "ScaleUp"),  # converged: the next step is allowed
        ],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decision_table(name: str) -> None:
    spec, replicas, ticks = CASES[name]
    run(ticks, spec, replicas)


def test_a_stuck_scale_up_stops_blocking_after_the_convergence_timeout() -> None:
    first = decide(pods(8), AutoscalerState(), SPEC, 1, 0.0)
    assert first.desired == 2
    held = decide(pods(20, not_ready=1), first.state, SPEC, 2, 100.0, convergence_timeout=300)
    assert held.reason == "ScaleUpInProgress" and held.desired == 2
    later = decide(pods(20, not_ready=1), held.state, SPEC, 2, 301.0, convergence_timeout=300)
    assert later.desired == 5 and later.reason == "ScaleUp"


def test_restart_in_the_middle_of_a_scale_down_window_continues_the_window() -> None:
    state, replicas = run([Tick(0, pods(16, 0, 0, 0), 4), Tick(30, pods(0, 0, 0, 0), 4)], replicas=4)
    stored = to_status(state)
    # A new operator process: nothing in memory, only what the status kept.
    restored = from_status(stored)
    assert restored == state
    assert decide(pods(0, 0, 0, 0), restored, SPEC, replicas, 45.0).desired == 4  # the window is not restarted ...
    assert decide(pods(0, 0, 0, 0), restored, SPEC, replicas, 91.0).desired == 1  # ... nor lost
    # Without the stored state the window would start over at the restart and still hold at t=91.
    fresh = decide(pods(0, 0, 0, 0), AutoscalerState(), SPEC, replicas, 45.0)
    assert fresh.desired == 4
    assert decide(pods(0, 0, 0, 0), fresh.state, SPEC, replicas, 91.0).desired == 4


def test_history_keeps_only_what_was_in_force_during_the_longer_window() -> None:
    state = AutoscalerState(recommendations=(Recommendation(0.0, 3), Recommendation(30.0, 2), Recommendation(50.0, 4)))
    decision = decide(pods(0), state, SPEC, 3, 100.0)  # the window starts at t=40, when the 2 was in force
    assert decision.state.recommendations == (Recommendation(30.0, 2), Recommendation(50.0, 4), Recommendation(100, 1))


def test_a_steady_recommendation_changes_no_state() -> None:
    """What lets a quiet tick write nothing: the history holds change points, not one entry per tick."""
    first = decide(pods(8, 0), AutoscalerState(), SPEC, 2, 0.0)
    later = decide(pods(8, 0), first.state, SPEC, 2, 15.0)
    assert later.state == first.state and (later.desired, later.reason) == (first.desired, first.reason)
    changed = decide(pods(12, 0), later.state, SPEC, 2, 30.0)
    assert changed.state.recommendations == (Recommendation(0.0, 2), Recommendation(30.0, 3))


def test_a_tick_that_measures_nothing_starts_the_scale_down_window_again() -> None:
    ticks = [
        Tick(0, pods(0, 0, 0), 3, "Stabilizing"),
        Tick(15, pods(not_ready=3), 3, "NoReadyPods"),  # counts as recommending the current 3 until measured again
        Tick(30, pods(0, 0, 0), 3, "Stabilizing"),
        Tick(89, pods(0, 0, 0), 3),
        Tick(91, pods(0, 0, 0), 1, "ScaleDown"),  # a whole window after t=30
    ]
    run(ticks, replicas=3)


def test_damaged_stored_state_starts_empty() -> None:
    assert from_status({"recommendations": [{"time": "x"}]}) == AutoscalerState()
    assert from_status(None) == AutoscalerState()


def test_decision_reports_the_metrics_behind_it() -> None:
    decision = decide(pods(3, 5, None, not_ready=1), AutoscalerState(), SPEC, 4, 0.0)
    m = decision.metrics
    assert (m.waiting, m.running, m.kv_cache_usage, m.pods_ready, m.pods_unknown) == (8, 2, 0.5, 3, 1)


ENGINE_METRICS = """\
# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="stories"} 3.0
vllm:num_requests_waiting{model_name="other"} 7.0
vllm:num_requests_running{model_name="stories"} 1.0
vllm:kv_cache_usage_perc{model_name="stories"} 0.25
vllm:num_requests_waiting_total 99
"""


def test_metrics_parser_reads_the_model_series_only() -> None:
    metrics = parse_metrics(ENGINE_METRICS, "stories")
    assert metrics is not None
    assert (metrics.waiting, metrics.running, metrics.kv_cache_usage) == (3.0, 1.0, 0.25)


def test_metrics_without_the_waiting_gauge_are_unknown() -> None:
    assert parse_metrics("vllm:num_requests_running 1\n", "stories") is None
    assert parse_metrics(ENGINE_METRICS, "absent-model") is None


def test_metrics_without_a_model_label_are_accepted() -> None:
    metrics = parse_metrics("vllm:num_requests_waiting 2\n", "stories")
    assert metrics is not None and metrics.waiting == 2 and metrics.running is None


@pytest.mark.parametrize(
    ("autoscaling", "runs"),
    [
        ({"enabled": True, "mode": "builtin", "maxReplicas": 3}, True),
        ({"enabled": True, "mode": "hpa", "maxReplicas": 3}, False),  # the HPA scales; two autoscalers would fight
        ({"enabled": False, "mode": "builtin"}, False),
        ({"enabled": True, "mode": "builtin", "minReplicas": 4, "maxReplicas": 2}, False),  # invalid spec
    ],
)
def test_only_builtin_mode_runs_the_loop(autoscaling: dict[str, object], runs: bool) -> None:
    body = {"metadata": {"name": "llm", "namespace": "default", "uid": "u"}, "spec": {"autoscaling": autoscaling}}
    assert builtin_enabled(body) is runs
