"""Two operator replicas with Lease leader election against a real kube-apiserver: one acts, the other takes over
within 15 s of the leader dying (SIGKILL), and at once when the leader exits cleanly (SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_plane import CLUSTER_SCRIPT, Cluster, start_logged, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")]

NS = "pagoda-ha"
LEASE = "pagoda-operator"
TAKEOVER_LIMIT_S = 15.0


def start_replica(cluster: Cluster, name: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "PAGODA_RECONCILE_INTERVAL": "2", "POD_NAME": name}
    command = [
        sys.executable,
        "-m",
        "pagoda_operator.run",
        f"--lease-name={LEASE}",
        f"--lease-namespace={NS}",
        f"--namespace={NS}",
        "--health-port=0",
        "--retry-seconds=1",
    ]
    return start_logged(command, env, log)


def holder(cluster: Cluster) -> str:
    lease = cluster.get("lease", LEASE, NS) or {}
    return (lease.get("spec") or {}).get("holderIdentity") or ""


@pytest.fixture()
def replicas(cluster: Cluster, tmp_path: Path) -> Iterator[dict[str, subprocess.Popen]]:
    running = {name: start_replica(cluster, name, tmp_path / f"{name}.log") for name in ("op-a", "op-b")}
    yield running
    for process in running.values():
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_one_replica_acts_and_a_standby_takes_over(cluster: Cluster, replicas, how: str) -> None:
    leader = wait_for("a leader", lambda: holder(cluster) in replicas and holder(cluster), 30)
    first, second = f"before-{how.lower()}", f"after-{how.lower()}"
    cluster.apply_md(first)
    wait_for("the leader to reconcile", lambda: cluster.get("deployment", first, NS), 30)
    time.sleep(3)  # a standby that acted too would post its own Created events by now
    assert len(cluster.events(first, "Created")) == 2  # Deployment and Service, by one replica

    replicas[leader].send_signal(getattr(signal, how))
    killed = time.monotonic()
    replicas[leader].wait(30)
    cluster.apply_md(second)
    standby = next(name for name in replicas if name != leader)
    wait_for("the standby to hold the lease", lambda: holder(cluster) == standby, TAKEOVER_LIMIT_S)
    wait_for("the new leader to reconcile", lambda: cluster.get("deployment", second, NS), TAKEOVER_LIMIT_S)
    took = time.monotonic() - killed
    print(f"takeover after {how}: {took:.1f} s")
    assert took < TAKEOVER_LIMIT_S, f"takeover took {took:.1f} s"
    if how == "SIGTERM":
        assert replicas[leader].returncode == 0
        assert took < 8, f"a released lease should be taken at the next attempt, took {took:.1f} s"
    cluster.kubectl("delete", "lease", LEASE, "-n", NS)  # the next case starts from no holder
