"""Rollouts without downtime, against a real kube-apiserver and controller-manager.

The disruption budget, the rollout strategy and the grace period reach the children as the spec says and follow
its changes; the built-in autoscaler marks idle pods cheap to delete before it scales down, so the ReplicaSet
controller removes those and keeps the busy ones; and a quiet autoscaler tick writes nothing.

There is no kubelet: pods are made Ready by patching their status as a kubelet would, with a loopback pod IP where a
real HTTP server answers ``/metrics`` on the engine's port (8000) with the gauges the test sets. The addresses are
drawn at random from 127.0.0.0/8, so another run of these tests on the same machine does not collide.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from control_plane import CLUSTER_SCRIPT, Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")]

NS = "pagoda-rollout"
OPERATOR_ENV = {"PAGODA_AUTOSCALE_INTERVAL": "0.5"}
ENGINE_PORT = 8000  # the port the Deployment's pods declare; each fake engine has its own loopback address
COST = "controller.kubernetes.io/pod-deletion-cost"


class FakeEngine:
    """A real HTTP server on ``ip``:8000 whose ``/metrics`` says what the test last set."""

    def __init__(self, ip: str, waiting: int, running: int) -> None:
        self.ip = ip
        self.waiting, self.running = waiting, running
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                body = (
                    f"vllm:num_requests_waiting {engine.waiting}\n"
                    f"vllm:num_requests_running {engine.running}\n"
                    "vllm:kv_cache_usage_perc 0.1\n"
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((ip, ENGINE_PORT), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, waiting: int, running: int) -> None:
        self.waiting, self.running = waiting, running

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def engine() -> Iterator[Callable[[int, int], FakeEngine]]:
    """Starts fake engines (waiting, running) on free loopback addresses; all closed after the test."""
    made: list[FakeEngine] = []

    def start(waiting: int, running: int) -> FakeEngine:
        for _ in range(20):
            ip = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
            try:
                made.append(FakeEngine(ip, waiting, running))
            except OSError:  # taken: draw again
                continue
            return made[-1]
        raise RuntimeError(f"no loopback address with port {ENGINE_PORT} free")

    yield start
    for fake in made:
        fake.close()


def make_ready(cluster: Cluster, pod: dict[str, Any], ip: str, ready_since: float) -> None:
    """What the kubelet writes once the engine's readiness probe passes, with ``ip`` as the pod's IP."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ready_since))
    conditions = [{"type": t, "status": "True", "lastTransitionTime": stamp} for t in ("Ready", "ContainersReady")]
    cluster.patch_pod_status(pod["metadata"]["name"], {"phase": "Running", "podIP": ip, "conditions": conditions})


def replicas(cluster: Cluster, name: str) -> int:
    return int(((cluster.get("deployment", name, NS) or {}).get("spec") or {}).get("replicas", -1))


def test_a_disruption_budget_guards_two_replicas_and_goes_with_the_second(cluster, operator) -> None:
    cluster.apply_md("guarded", replicas=2)
    pdb = wait_for("the PodDisruptionBudget", lambda: cluster.get("poddisruptionbudget", "guarded", NS), 60)
    deployment = wait_for("the Deployment", lambda: cluster.get("deployment", "guarded", NS), 30)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    (owner,) = pdb["metadata"]["ownerReferences"]
    assert owner["kind"] == "ModelDeployment" and owner["name"] == "guarded" and owner["controller"] is True
    # The disruption controller takes it up: it selects the two pods.
    wait_for(
        "the budget's status",
        lambda: (cluster.get("poddisruptionbudget", "guarded", NS).get("status") or {}).get("expectedPods") == 2,
        30,
    )
    cluster.apply_md("guarded", replicas=1)
    wait_for("the budget deleted", lambda: cluster.get("poddisruptionbudget", "guarded", NS) is None, 30)
    cluster.apply_md("guarded", autoscaling={"enabled": True, "mode": "hpa", "minReplicas": 2, "maxReplicas": 4})
    wait_for("the budget back for minReplicas 2", lambda: cluster.get("poddisruptionbudget", "guarded", NS), 30)


def rollout_of(cluster: Cluster, name: str) -> tuple[dict[str, Any], int, str]:
    """The Deployment's rolling update, grace period and the engine's --shutdown-timeout."""
    spec = (cluster.get("deployment", name, NS) or {}).get("spec") or {}
    if not spec:
        return {}, 0, ""
    pod = spec["template"]["spec"]
    args = pod["containers"][0]["args"]
    timeout = args[args.index("--shutdown-timeout") + 1]
    return spec["strategy"]["rollingUpdate"], pod["terminationGracePeriodSeconds"], timeout


def test_rollout_bounds_and_drain_time_follow_the_spec(cluster, operator) -> None:
    cluster.apply_md("rolled", gpus=1)
    defaults = ({"maxSurge": 1, "maxUnavailable": 0}, 5 + 30 + 10, "30")  # a GPU model surges too, by default
    wait_for("the default rollout", lambda: rollout_of(cluster, "rolled") == defaults, 60)
    cluster.apply_md("rolled", gpus=1, rollout={"maxSurge": 0, "maxUnavailable": 1}, drainSeconds=120)
    changed = ({"maxSurge": 0, "maxUnavailable": 1}, 5 + 120 + 10, "120")
    wait_for("the chosen rollout and drain", lambda: rollout_of(cluster, "rolled") == changed, 30)
    cluster.apply_md("rolled", gpus=1)  # both removed from the spec: back to the defaults
    wait_for("the defaults again", lambda: rollout_of(cluster, "rolled") == defaults, 30)


def decision(cluster: Cluster, name: str) -> dict[str, Any]:
    return ((cluster.get("modeldeployment", name, NS) or {}).get("status") or {}).get("lastDecision") or {}


BUILTIN = {"enabled": True, "mode": "builtin", "minReplicas": 1, "maxReplicas": 3, "targetWaitingRequests": 1}


def test_scale_down_removes_the_idle_pod_and_keeps_the_busy_ones(cluster, operator, engine) -> None:
    cluster.apply_md("idle-first", autoscaling={**BUILTIN, "scaleDownStabilizationSeconds": 1})
    (first,) = wait_for("the first pod", lambda: cluster.pods_of("idle-first"), 60)
    oldest = engine(5, 1)  # a queue: scale up to 3 at once
    make_ready(cluster, first, oldest.ip, ready_since=time.time() - 600)

    def the_new_pods() -> list[dict[str, Any]]:
        # by name: creation timestamps have whole seconds, and the scale-up may come within the first pod's second
        pods = [p for p in cluster.pods_of("idle-first") if p["metadata"]["name"] != first["metadata"]["name"]]
        return pods if len(pods) == 2 else []

    new = wait_for("two more pods", the_new_pods, 30)
    for pod, (waiting, running) in zip(new, ((1, 3), (1, 2))):
        make_ready(cluster, pod, engine(waiting, running).ip, ready_since=time.time())
    wait_for("three measured pods", lambda: decision(cluster, "idle-first").get("podsReady") == 3, 30)
    # The oldest pod goes idle: 2 waiting in all, so one pod too many. Left to itself, the ReplicaSet controller
    # would delete one of the two pods that have been ready for less time; the deletion costs make it the idle one.
    oldest.set(waiting=0, running=0)
    wait_for("the scale-down", lambda: len(cluster.pods_of("idle-first")) == 2, 30)
    survivors = {
        p["metadata"]["name"]: p["metadata"].get("annotations", {}).get(COST) for p in cluster.pods_of("idle-first")
    }
    assert survivors == {new[0]["metadata"]["name"]: "3", new[1]["metadata"]["name"]: "2"}
    assert replicas(cluster, "idle-first") == 2


def test_quiet_autoscaler_ticks_write_nothing(cluster, operator, engine) -> None:
    cluster.apply_md("steady", autoscaling={**BUILTIN, "targetWaitingRequests": 4})
    (pod,) = wait_for("the pod", lambda: cluster.pods_of("steady"), 60)
    steady = engine(1, 1)
    make_ready(cluster, pod, steady.ip, ready_since=time.time())

    def ready_and_measured() -> bool:
        ready = cluster.md_condition("steady", "Ready").get("status") == "True"
        return ready and decision(cluster, "steady").get("podsReady") == 1

    wait_for("the resource Ready and measured", ready_and_measured, 30)
    version = cluster.get("modeldeployment", "steady", NS)["metadata"]["resourceVersion"]
    # Eight autoscaler ticks and two reconciles; the load moves, the decision (1 replica, Stable) does not.
    for step in range(8):
        steady.set(waiting=step % 3, running=step % 4)
        time.sleep(0.5)
    assert cluster.get("modeldeployment", "steady", NS)["metadata"]["resourceVersion"] == version
    assert decision(cluster, "steady")["reason"] == "Stable"
