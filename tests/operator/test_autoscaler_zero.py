"""Scale to and from zero in the built-in autoscaler (``minReplicas: 0``).

The router stamps ``pagoda.dev/demand-at`` on a ModelDeployment while it holds requests for a model with no ready
pod; a stamp younger than ``DEMAND_TTL_SECONDS`` is demand, and demand at zero replicas orders the first replica at
once. A model goes to zero only after a whole scale-down window of measured idleness (nothing waiting, nothing
running, no demand); a model serving requests with an empty queue is never dropped.

The decisions are pure (``decide`` and ``autoscaler.demand`` take ``now`` and the stamp); the last test runs the
operator against a real API server and controller-manager: the annotation alone makes it scale a Deployment from 0.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import pytest
from control_plane import CLUSTER_SCRIPT, Cluster, wait_for
from test_rollout_cluster import engine, make_ready  # noqa: F401  (engine: fake engines on loopback, a fixture)

from pagoda_operator.autoscaler.algorithm import AutoscalerState, EngineMetrics, PodSample, decide
from pagoda_operator.autoscaler.demand import format_stamp, has_demand, is_fresh, parse_stamp
from pagoda_operator.autoscaler.loop import event_reason
from pagoda_operator.constants import DEMAND_ANNOTATION, DEMAND_STATUS_FIELD, DEMAND_TTL_SECONDS
from pagoda_operator.spec import Autoscaling

ZERO = Autoscaling(
    enabled=True,
    mode="builtin",
    min_replicas=0,
    max_replicas=4,
    target_waiting_requests=4,
    scale_up_stabilization_seconds=30,  # a window the first replica must not wait for
    scale_down_stabilization_seconds=60,
)
NOW = 1_800_000_000.0


def busy(waiting: float, running: Optional[float]) -> PodSample:
    return PodSample("p", True, EngineMetrics(waiting, running, 0.1))


@dataclass(frozen=True)
class Tick:
    time: float
    pods: list[PodSample]
    expected: int
    reason: Optional[str] = None
    demand: bool = False


def run(ticks: list[Tick], replicas: int, spec: Autoscaling = ZERO) -> None:
    """Feed the ticks in order, applying each decision as the Deployment would; assert every expectation."""
    state = AutoscalerState()
    for tick in ticks:
        decision = decide(tick.pods, state, spec, replicas, tick.time, demand=tick.demand)
        assert decision.desired == tick.expected, (tick, decision)
        if tick.reason is not None:
            assert decision.reason == tick.reason, (tick, decision)
        state, replicas = decision.state, decision.desired


# --- the demand stamp -----------------------------------------------------------------------------------------


def test_a_stamp_younger_than_the_ttl_is_demand_and_an_older_one_is_not() -> None:
    stamp = format_stamp(NOW)
    assert stamp.endswith("Z") and parse_stamp(stamp) == NOW
    assert is_fresh(stamp, NOW + DEMAND_TTL_SECONDS - 1)
    assert not is_fresh(stamp, NOW + DEMAND_TTL_SECONDS + 1)
    assert is_fresh("2027-01-15T08:00:00.250+00:00", parse_stamp("2027-01-15T08:00:30Z"))  # fractions and offsets


def test_a_stamp_far_in_the_future_does_not_pin_the_model_up() -> None:
    assert is_fresh(format_stamp(NOW + 5), NOW)  # a router clock a little ahead still counts
    assert not is_fresh(format_stamp(NOW + 10 * DEMAND_TTL_SECONDS), NOW)


@pytest.mark.parametrize("garbled", ["", "yesterday", "2026-13-45T99:00:00Z", "1800000000", "Z"])
def test_a_garbled_stamp_is_no_demand_and_is_logged_at_debug(garbled: str, caplog: pytest.LogCaptureFixture) -> None:
    body = {"metadata": {"annotations": {DEMAND_ANNOTATION: garbled}}}
    with caplog.at_level(logging.DEBUG, logger="pagoda_operator.autoscaler"):
        assert not has_demand(body, NOW)
    if garbled:
        assert any(DEMAND_ANNOTATION in r.message and r.levelno == logging.DEBUG for r in caplog.records)


def test_a_body_without_annotations_has_no_demand() -> None:
    assert not has_demand({"metadata": {}}, NOW) and not has_demand({}, NOW)
    assert has_demand({"metadata": {"annotations": {DEMAND_ANNOTATION: format_stamp(NOW - 10)}}}, NOW)
    assert has_demand({"status": {DEMAND_STATUS_FIELD: format_stamp(NOW - 10)}}, NOW)  # the router's
    assert not has_demand({"status": {DEMAND_STATUS_FIELD: format_stamp(NOW - 10 - DEMAND_TTL_SECONDS)}}, NOW)


# --- from zero ------------------------------------------------------------------------------------------------


def test_demand_at_zero_replicas_orders_the_first_replica_at_once() -> None:
    decision = decide([], AutoscalerState(), ZERO, 0, NOW, demand=True)
    assert (decision.desired, decision.reason) == (1, "ScaleFromZero")
    assert decision.state.last_scale_up_time == NOW  # the convergence guard covers the first pod's start
    assert event_reason(decision.desired, 0) == "ScaledFromZero"


def test_a_remembered_zero_does_not_hold_back_the_first_replica() -> None:
    # At zero for a while, a 30 s scale-up window: demand still wins the first replica on its first tick.
    run(
        [
            Tick(NOW, [], 0, "ScaledToZero"),
            Tick(NOW + 15, [], 0, "ScaledToZero"),
            Tick(NOW + 20, [], 1, "ScaleFromZero", demand=True),
            Tick(NOW + 25, [PodSample("p", False)], 1, "NoReadyPods", demand=True),  # starting: no second order
        ],
        replicas=0,
    )


def test_without_demand_a_model_at_zero_stays_there_with_one_quiet_decision() -> None:
    first = decide([], AutoscalerState(), ZERO, 0, NOW)
    later = decide([], first.state, ZERO, 0, NOW + 30)
    assert (first.desired, first.reason) == (0, "ScaledToZero") and later.desired == 0
    assert later.state == first.state  # nothing new to remember: the status is not rewritten


def test_demand_for_a_model_with_replicas_starting_orders_nothing_more() -> None:
    decision = decide([PodSample("p", False)], AutoscalerState(), ZERO, 1, NOW, demand=True)
    assert (decision.desired, decision.reason) == (1, "NoReadyPods")


# --- to zero --------------------------------------------------------------------------------------------------


def test_a_model_idle_for_the_whole_window_goes_to_zero() -> None:
    run(
        [
            Tick(NOW, [busy(0, 2)], 1, "Stable"),
            Tick(NOW + 10, [busy(0, 0)], 1, "Stabilizing"),  # idle from here
            Tick(NOW + 69, [busy(0, 0)], 1, "Stabilizing"),  # 59 s of a 60 s window
            Tick(NOW + 70, [busy(0, 0)], 0, "ScaleToZero"),
        ],
        replicas=1,
    )
    assert event_reason(0, 1) == "ScaledToZero"


def test_a_busy_model_with_an_empty_queue_never_goes_to_zero() -> None:
    # ceil(waiting / target) alone would say 0 replicas for every one of these ticks.
    run([Tick(NOW + t, [busy(0, 3)], 1, "Stable") for t in range(0, 600, 15)], replicas=1)


def test_any_activity_starts_the_idle_window_over() -> None:
    run(
        [
            Tick(NOW, [busy(0, 0)], 1),
            Tick(NOW + 50, [busy(0, 1)], 1),  # one request ran
            Tick(NOW + 55, [busy(0, 0)], 1),
            Tick(NOW + 100, [busy(0, 0)], 1, "Stabilizing"),  # idle again for 45 s only
            Tick(NOW + 115, [busy(0, 0)], 0, "ScaleToZero"),
        ],
        replicas=1,
    )


def test_a_fresh_demand_stamp_keeps_an_idle_model_up() -> None:
    run([Tick(NOW + t, [busy(0, 0)], 1, "Stable", demand=True) for t in range(0, 300, 15)], replicas=1)


@pytest.mark.parametrize(
    "pods",
    [
        [PodSample("p", True)],  # /metrics unreadable
        [busy(0, 0), PodSample("q", True)],  # one of two pods unreadable
        [busy(0, None)],  # an engine without vllm:num_requests_running: its running requests are unknown
    ],
    ids=["unreadable", "one-unreadable", "no-running-gauge"],
)
def test_unknown_metrics_are_never_idle(pods: list[PodSample]) -> None:
    replicas = sum(p.ready for p in pods)
    run([Tick(NOW + t, pods, replicas) for t in range(0, 600, 15)], replicas=replicas)


def test_a_model_with_no_ready_pod_is_not_dropped_to_zero() -> None:
    # Replicas ordered, pods still loading the model: nothing measured, so nothing says idle.
    run([Tick(NOW + t, [PodSample("p", False)], 1, "NoReadyPods") for t in range(0, 600, 15)], replicas=1)


def test_with_min_replicas_one_an_idle_model_keeps_its_replica() -> None:
    one = Autoscaling(enabled=True, min_replicas=1, max_replicas=4, scale_down_stabilization_seconds=0)
    run([Tick(NOW + t, [busy(0, 0)], 1, "Stable") for t in range(0, 120, 15)], replicas=1, spec=one)


# --- against the real control plane ---------------------------------------------------------------------------

NS = "pagoda-zero"
OPERATOR_ENV = {"PAGODA_AUTOSCALE_INTERVAL": "0.5"}


def _replicas(cluster: Cluster, name: str) -> int:
    return int(((cluster.get("deployment", name, NS) or {}).get("spec") or {}).get("replicas", -1))


def _decision(cluster: Cluster, name: str) -> dict[str, Any]:
    return ((cluster.get("modeldeployment", name, NS) or {}).get("status") or {}).get("lastDecision") or {}


def _replicas_managers(cluster: Cluster, name: str) -> set[str]:
    """Who owns the Deployment's replicas (kubectl hides managedFields unless asked)."""
    args = ("get", "deployment", name, "-n", NS, "-o", "json", "--show-managed-fields")
    fields = json.loads(cluster.kubectl(*args).stdout)["metadata"]["managedFields"]
    return {f["manager"] for f in fields if "f:replicas" in f["fieldsV1"].get("f:spec", {})}


@pytest.mark.slow
@pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")
def test_a_demand_stamp_scales_a_deployment_from_zero(cluster: Cluster, operator: Any) -> None:
    scaling = {"enabled": True, "mode": "builtin", "minReplicas": 0, "maxReplicas": 2}
    cluster.apply_md("sleeper", autoscaling=scaling)
    wait_for("the Deployment at 0", lambda: _replicas(cluster, "sleeper") == 0, 60)
    status = lambda: (cluster.get("modeldeployment", "sleeper", NS) or {}).get("status") or {}  # noqa: E731
    wait_for("the decision to stay at zero", lambda: status().get("lastDecision", {}).get("reason") == "ScaledToZero")
    version = cluster.get("modeldeployment", "sleeper", NS)["metadata"]["resourceVersion"]
    time.sleep(2.5)  # five ticks without demand: no pod, no write
    assert _replicas(cluster, "sleeper") == 0 and cluster.pods_of("sleeper") == []
    assert cluster.get("modeldeployment", "sleeper", NS)["metadata"]["resourceVersion"] == version

    # What the router writes: the annotation, nothing else.
    stamp = f"{DEMAND_ANNOTATION}={format_stamp(time.time())}"
    cluster.kubectl("annotate", "modeldeployment", "sleeper", "-n", NS, stamp, "--overwrite")
    wait_for("one replica", lambda: _replicas(cluster, "sleeper") == 1, 30)
    wait_for("its pod", lambda: len(cluster.pods_of("sleeper")) == 1, 30)
    assert wait_for("the Event", lambda: cluster.events("sleeper", "ScaledFromZero"), 30)
    assert _replicas_managers(cluster, "sleeper") == {"pagoda-autoscaler"}
    assert status()["lastDecision"]["reason"] in ("ScaleFromZero", "NoReadyPods")


@pytest.mark.slow
@pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")
def test_a_busy_model_stays_up_and_an_idle_one_goes_back_to_zero(
    cluster: Cluster,
    operator: Any,
    engine: Any,  # noqa: F811  (the fixture imported above)
) -> None:
    scaling = {"enabled": True, "minReplicas": 0, "maxReplicas": 2, "scaleDownStabilizationSeconds": 1}
    cluster.apply_md("napper", autoscaling=scaling)
    wait_for("the Deployment at 0", lambda: _replicas(cluster, "napper") == 0, 60)
    stamp = f"{DEMAND_ANNOTATION}={format_stamp(time.time())}"
    cluster.kubectl("annotate", "modeldeployment", "napper", "-n", NS, stamp, "--overwrite")
    (pod,) = wait_for("its pod", lambda: cluster.pods_of("napper"), 30)
    fake = engine(0, 3)  # serving three requests, none waiting: ceil(0 / target) alone would say zero
    make_ready(cluster, pod, fake.ip, ready_since=time.time())
    cluster.kubectl("annotate", "modeldeployment", "napper", "-n", NS, f"{DEMAND_ANNOTATION}-")  # demand gone
    wait_for("the pod measured", lambda: _decision(cluster, "napper").get("podsReady") == 1, 30)
    time.sleep(3)  # six ticks, three scale-down windows
    assert _replicas(cluster, "napper") == 1
    fake.set(waiting=0, running=0)
    wait_for("zero replicas", lambda: _replicas(cluster, "napper") == 0, 30)
    assert cluster.events("napper", "ScaledToZero")
