"""Leader election that cannot overlap, against a real kube-apiserver: a leader whose API server hangs stops
acting within its renew deadline, before a standby can take the Lease, and a leader frozen (SIGSTOP) past its
deadline writes nothing once it resumes (a LeaseElector writing in a loop, and the real ``pagoda_operator.run``): the
fence refuses every write, ours and kopf's, and the Lease stays the new holder's.

Leases are 3 s (renew deadline 2 s), so each case takes seconds."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kopf
import pytest
import pytest_asyncio
import yaml
from control_plane import CLUSTER_SCRIPT, Cluster, wait_for
from slow_proxy import SlowProxy

from pagoda_operator.kube import KubeClient, object_path
from pagoda_operator.leader import LeadershipLost, LeaseElector

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio,
    pytest.mark.timeout(60),
    pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster"),
]

NS = "pagoda-fencing"
LEASE_S = 3
WRITER = Path(__file__).with_name("fenced_writer.py")


def client(kubeconfig: str, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> KubeClient:
    """A KubeClient logged in from ``kubeconfig``, as the operator logs in (kopf's kubeconfig login)."""
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    return KubeClient.from_environment(kopf.OperatorSettings(), **kwargs)


def through(proxy: SlowProxy, kubeconfig: str, path: Path) -> str:
    """A copy of ``kubeconfig`` that reaches the API server through ``proxy`` (same certificate, same user)."""
    config = yaml.safe_load(Path(kubeconfig).read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest_asyncio.fixture()
async def proxy(cluster: Cluster) -> AsyncIterator[SlowProxy]:
    server = yaml.safe_load(Path(cluster.kubeconfig).read_text())["clusters"][0]["cluster"]["server"]
    url = urllib.parse.urlparse(server)
    running = await SlowProxy(url.hostname or "127.0.0.1", url.port or 443).start()
    yield running
    await running.close()


def finished_at(task: asyncio.Task[Any], times: dict[str, float], key: str) -> None:
    """Record in ``times[key]`` the monotonic time ``task`` ends."""
    task.add_done_callback(lambda _: times.setdefault(key, time.monotonic()))


async def sample(beliefs: list[tuple[float, bool, bool]], a: Callable[[], bool], b: Callable[[], bool]) -> None:
    """Every 10 ms, whether each replica believes it may act."""
    while True:
        beliefs.append((time.monotonic(), a(), b()))
        await asyncio.sleep(0.01)


def kill_frozen(process: subprocess.Popen) -> None:
    """Kill a leader subprocess the test may have left running or stopped (resumed first, then killed)."""
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(10)


async def test_a_leader_behind_a_hung_api_server_stops_before_a_standby_takes_over(
    cluster: Cluster, proxy: SlowProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = client(through(proxy, cluster.kubeconfig, tmp_path / "slow.kubeconfig"), monkeypatch)
    direct = client(cluster.kubeconfig, monkeypatch)
    a = LeaseElector(slow, NS, "hung", "op-a", lease_seconds=LEASE_S, retry_seconds=0.5)
    b = LeaseElector(direct, NS, "hung", "op-b", lease_seconds=LEASE_S, retry_seconds=0.3)
    fenced_writes = client(cluster.kubeconfig, monkeypatch, fence=a.fence)  # a's write path, not slowed down
    await a.acquire()
    times: dict[str, float] = {}
    keeper, standby = asyncio.create_task(a.keep()), asyncio.create_task(b.acquire())
    finished_at(keeper, times, "a stopped")
    finished_at(standby, times, "b leads")
    beliefs: list[tuple[float, bool, bool]] = []
    sampler = asyncio.create_task(sample(beliefs, a.is_leading, b.is_leading))
    try:
        await asyncio.sleep(1.5)  # a renews as usual; b stands by
        assert a.is_leading() and not standby.done()
        proxy.delay = 120  # the API server stops answering a, in the middle of its renewals
        await asyncio.wait({keeper}, timeout=2 * LEASE_S)
        assert keeper.done(), "the leader still believed it led two lease periods after its API server hung"
        last_renewal = a.deadline - a.renew_deadline
        print(f"leader stopped {times['a stopped'] - last_renewal:.2f} s after its last renewal")
        assert times["a stopped"] - last_renewal < a.renew_deadline + 0.5 < LEASE_S
        assert not a.is_leading()
        with pytest.raises(LeadershipLost):  # what the leader's operator would write now is refused
            await fenced_writes.create(object_path("v1", "configmaps", NS), configmap("written-after-deadline"))
        assert cluster.get("configmap", "written-after-deadline", NS) is None

        await asyncio.wait_for(standby, 3 * LEASE_S)
        gap = times["b leads"] - times["a stopped"]
        print(f"standby took over {gap:.2f} s after the leader stopped")
        assert gap > 0.5, f"the standby led only {gap:.2f} s after the old leader stopped acting"
        assert not [t for t, a_leads, b_leads in beliefs if a_leads and b_leads], "two replicas led at once"
    finally:
        for task in (sampler, keeper, standby):
            task.cancel()
        await asyncio.gather(sampler, keeper, standby, return_exceptions=True)
        for kube in (slow, direct, fenced_writes):
            await kube.close()


def configmap(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": NS}}


def resource_version(obj: dict[str, Any]) -> int:
    """An object's resourceVersion as a number: etcd's revision, which orders every write of the cluster."""
    return int(obj["metadata"]["resourceVersion"])


async def test_a_frozen_leader_writes_nothing_once_it_resumes(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "op-a.log"
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig}
    with open(log, "w") as out:
        leader = subprocess.Popen(
            [sys.executable, str(WRITER), NS, "frozen", "op-a"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    b = LeaseElector(client(cluster.kubeconfig, monkeypatch), NS, "frozen", "op-b", LEASE_S, retry_seconds=0.3)
    try:
        await asyncio.to_thread(wait_for, "op-a to lead", lambda: "leading" in log.read_text(), 20)
        standby = asyncio.create_task(b.acquire())
        await asyncio.sleep(1.0)  # op-a writes, op-b sees it renew
        assert cluster.items("configmaps", "-l", "writer=op-a"), "the leader wrote nothing while it led"
        leader.send_signal(signal.SIGSTOP)
        await asyncio.wait_for(standby, 3 * LEASE_S)
        took_over = resource_version(await b.kube.get(b.path))  # every later write of the cluster has a higher one
        await asyncio.sleep(0.5)
        leader.send_signal(signal.SIGCONT)
        status = await asyncio.to_thread(leader.wait, 10)
        output = log.read_text()
        assert status == 1, output
        written = cluster.items("configmaps", "-l", "writer=op-a")
        late = [m["metadata"]["name"] for m in written if resource_version(m) > took_over]
        assert not late, f"the resumed leader wrote after the standby took over: {late}"
        assert "fenced" in output, f"the resumed leader did not even try to write: {output}"
        lease = await b.kube.get(b.path)
        assert lease is not None and lease["spec"]["holderIdentity"] == "op-b"
    finally:
        kill_frozen(leader)
        await b.kube.close()


async def test_a_frozen_operator_replica_neither_reconciles_nor_patches_once_it_resumes(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real ``pagoda_operator.run``: frozen as leader, it wakes to a changed ModelDeployment and a deleted child,
    work it would do at once, and must do none of it (ours nor kopf's writes), then exit 1."""
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "PAGODA_RECONCILE_INTERVAL": "1", "POD_NAME": "op-a"}
    flags = [f"--lease-namespace={NS}", f"--namespace={NS}", f"--lease-seconds={LEASE_S}", "--retry-seconds=0.5"]
    command = [sys.executable, "-m", "pagoda_operator.run", "--lease-name=frozen-operator", *flags, "--health-port=0"]
    log = tmp_path / "op-a.log"
    with open(log, "w") as out:
        leader = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    b = LeaseElector(client(cluster.kubeconfig, monkeypatch), NS, "frozen-operator", "op-b", LEASE_S, 0.3)
    try:
        cluster.apply_md("frozen")
        await asyncio.to_thread(wait_for, "op-a to reconcile", lambda: cluster.get("deployment", "frozen", NS), 30)
        standby = asyncio.create_task(b.acquire())
        await asyncio.sleep(1.0)  # op-b sees op-a renew
        leader.send_signal(signal.SIGSTOP)
        await asyncio.wait_for(standby, 3 * LEASE_S)
        cluster.kubectl("delete", "deployment", "frozen", "-n", NS)  # both are work the operator would do at once
        cluster.apply_md("frozen", replicas=2)
        changed = resource_version(cluster.get("modeldeployment", "frozen", NS) or {})
        leader.send_signal(signal.SIGCONT)
        status = await asyncio.to_thread(leader.wait, 15)
        assert status == 1, log.read_text()
        assert cluster.get("deployment", "frozen", NS) is None, "the resumed leader restored the Deployment"
        md = cluster.get("modeldeployment", "frozen", NS) or {}
        assert resource_version(md) == changed, "the resumed leader (kopf) patched the ModelDeployment"
        events = [e for e in cluster.items("events") if e["involvedObject"]["kind"] == "ModelDeployment"]
        assert not [e for e in events if resource_version(e) > changed], "the resumed leader posted Events"
        assert "write refused" in log.read_text(), "the resumed leader did not even try to act"
    finally:
        kill_frozen(leader)
        await b.kube.close()
