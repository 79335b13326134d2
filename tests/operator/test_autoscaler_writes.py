"""What the built-in autoscaler writes, pure: deletion costs before a scale-down, status only on a changed decision."""

from __future__ import annotations

from typing import Any, Optional

from pagoda_operator.autoscaler.algorithm import EngineMetrics, PodSample, decide, from_status
from pagoda_operator.autoscaler.deletion_cost import DELETION_COST, deletion_costs
from pagoda_operator.autoscaler.loop import decision_status, status_update
from pagoda_operator.spec import Autoscaling

SPEC = Autoscaling(enabled=True, min_replicas=1, max_replicas=6, target_waiting_requests=4)


def pod(name: str, ready: bool = True, cost: Optional[str] = None) -> dict[str, Any]:
    annotations = {} if cost is None else {DELETION_COST: cost}
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {
        "metadata": {"name": name, "annotations": annotations},
        "status": {"podIP": "10.0.0.1", "conditions": conditions},
    }


def test_each_ready_pod_costs_its_running_requests() -> None:
    pods = [pod("busy"), pod("idle"), pod("some")]
    samples = [
        PodSample("busy", True, EngineMetrics(0, 7)),
        PodSample("idle", True, EngineMetrics(0, 0)),
        PodSample("some", True, EngineMetrics(1, 2.4)),
    ]
    assert deletion_costs(pods, samples) == {"busy": "7", "idle": "0", "some": "2"}


def test_only_changed_costs_are_written() -> None:
    pods = [pod("a", cost="3"), pod("b", cost="1")]
    samples = [PodSample("a", True, EngineMetrics(0, 3)), PodSample("b", True, EngineMetrics(0, 0))]
    assert deletion_costs(pods, samples) == {"b": "0"}


def test_pods_without_a_known_count_are_left_alone() -> None:
    pods = [pod("starting", ready=False), pod("unknown"), pod("old-engine"), pod("gone-from-the-scrape")]
    samples = [
        PodSample("starting", False),
        PodSample("unknown", True),  # /metrics could not be read: unknown is not idle
        PodSample("old-engine", True, EngineMetrics(0, None)),  # no vllm:num_requests_running
    ]
    assert deletion_costs(pods, samples) == {}


def status_after(samples: list[PodSample], previous: dict[str, Any], now: float) -> Optional[dict[str, Any]]:
    """One tick at 2 replicas, as ``autoscale_once`` runs it: decide from the stored state, then diff the status."""
    decision = decide(samples, from_status(previous.get("autoscaler")), SPEC, 2, now)
    return status_update(previous, decision_status(decision, 2))


def stored(status: Any) -> Any:
    """What the API server keeps of a merge patch: keys set to null are gone."""
    if isinstance(status, dict):
        return {k: stored(v) for k, v in status.items() if v is not None}
    return status


def test_a_quiet_tick_writes_nothing() -> None:
    first = status_after(
        [PodSample("a", True, EngineMetrics(4, 1)), PodSample("b", True, EngineMetrics(4, 1))], {}, 0.0
    )
    assert first is not None and first["lastDecision"]["reason"] == "Stable"
    live = stored(first)
    # the same decision with other metric values (and no kv-cache gauge, stored as an absent key): nothing to write
    assert (
        status_after([PodSample("a", True, EngineMetrics(5, 3)), PodSample("b", True, EngineMetrics(3, 0))], live, 15.0)
        is None
    )


def test_a_changed_decision_writes_the_decision_and_its_history() -> None:
    live = stored(
        status_after([PodSample("a", True, EngineMetrics(4, 1)), PodSample("b", True, EngineMetrics(4, 1))], {}, 0.0)
    )
    changes = status_after(
        [PodSample("a", True, EngineMetrics(8, 1)), PodSample("b", True, EngineMetrics(8, 1))], live, 15.0
    )
    assert changes is not None and set(changes) == {"desiredReplicas", "lastDecision", "autoscaler", "lastScaleTime"}
    assert changes["lastDecision"]["reason"] == "ScaleUp" and changes["lastDecision"]["waiting"] == 16
