"""The built-in autoscaler under real load: two real ``pagoda serve`` engines as the pods of a ModelDeployment.

The engines listen on loopback aliases (127.0.0.2 and 127.0.0.3, the same port), registered as pods in kmock's
emulator with those pod IPs and Ready conditions; the operator runs in-process with a 0.5 s autoscaler interval and
scrapes them for real. Replicas of the emulated Deployment are what the autoscaler decides (no controller acts on
them), so the pods stay the two engines throughout.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest

from pagoda_operator.builders import Owner, build_deployment, build_pdb, build_service
from pagoda_operator.spec import parse_spec

# The autoscaler's interval is read when pagoda_operator.main is imported (by the cluster fixture), so set it first.
os.environ.setdefault("PAGODA_AUTOSCALE_INTERVAL", "0.5")

from test_operator_kmock import (  # noqa: E402  (after the environment it depends on)
    DEPLOYMENTS,
    MD_PATH,
    NS,
    PODS,
    SERVICES,
    VERBS,
    _events,
    cluster,  # noqa: F401  (the fixture)
    create,
    eventually,
    get,
    model_deployment,
    patch,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.timeout(150)]

HOSTS = ("127.0.0.2", "127.0.0.3")
PDBS = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets"
MODEL = "stories"
PAGODA = Path(sys.executable).with_name("pagoda")


def _free_port() -> int:
    """A port free on both loopback aliases."""
    for _ in range(20):
        with socket.socket() as first:
            first.bind((HOSTS[0], 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind((HOSTS[1], port))
                except OSError:
                    continue
        return port
    raise RuntimeError("no port free on both loopback aliases")


def _wait_ready(host: str, port: int, process: subprocess.Popen[bytes], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"pagoda serve on {host} exited with {process.returncode}"
        try:
            connection = http.client.HTTPConnection(host, port, timeout=1)
            connection.request("GET", "/ready")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"pagoda serve on {host}:{port} was not ready within {timeout}s")


@pytest.fixture()
def engines(tmp_path: Path) -> Iterator[tuple[int, list[subprocess.Popen[bytes]]]]:
    """Two engines with the built-in model, one request at a time each, so a burst queues."""
    if not PAGODA.exists() and shutil.which("pagoda") is None:
        pytest.skip("the pagoda engine is not installed next to this interpreter")
    port = _free_port()
    command = [str(PAGODA) if PAGODA.exists() else "pagoda", "serve", "--port", str(port)]
    command += ["--served-model-name", MODEL, "--max-num-seqs", "1", "--log-level", "warning"]
    processes = []
    for host in HOSTS:
        log = (tmp_path / f"engine-{host}.log").open("wb")
        processes.append(subprocess.Popen([*command, "--host", host], stdout=log, stderr=subprocess.STDOUT))
    try:
        for host, process in zip(HOSTS, processes):
            _wait_ready(host, port, process)
        yield port, processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


def _pod(name: str, ip: str, port: int, labels: dict[str, str], ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def _burst(host: str, port: int, count: int) -> threading.Thread:
    """``count`` concurrent completions to one engine, in daemon threads; errors (a killed engine) are ignored."""

    def one() -> None:
        # Long enough (6 x 200 tokens, one sequence at a time) that the queue outlives several autoscaler ticks
        # even on a fast, quiet machine.
        body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True})
        try:
            connection = http.client.HTTPConnection(host, port, timeout=60)
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            connection.getresponse().read()
        except OSError:
            pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()

    def join_all() -> None:
        for thread in threads:
            thread.join(timeout=60)

    joiner = threading.Thread(target=join_all, daemon=True)
    joiner.start()
    return joiner


async def _replicas(emulator: kmock.KubernetesEmulator) -> int:
    return int((await get(emulator, f"{DEPLOYMENTS}/llm"))["spec"]["replicas"])


async def _decision(emulator: kmock.KubernetesEmulator) -> dict[str, Any]:
    md = await get(emulator, f"{MD_PATH}/llm")
    return ((md or {}).get("status") or {}).get("lastDecision") or {}


async def test_replicas_follow_real_queue_depth_and_a_dead_engine_never_scales_down(
    cluster: kmock.KubernetesEmulator,  # noqa: F811  (the imported fixture)
    engines: tuple[int, list[subprocess.Popen[bytes]]],
) -> None:
    main = sys.modules["pagoda_operator.main"]
    assert main.AUTOSCALE_INTERVAL == 0.5, "pagoda_operator.main was imported before PAGODA_AUTOSCALE_INTERVAL was set"
    port, processes = engines
    scaling = {
        "enabled": True,
        "mode": "builtin",
        "minReplicas": 2,
        "maxReplicas": 4,
        "targetWaitingRequests": 2,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 3,
    }
    body = model_deployment("llm", model={"servedModelName": MODEL}, autoscaling=scaling)
    # kmock has no server-side apply to create children with: the Deployment (at minReplicas), the Service and
    # the disruption budget (two replicas at least) are there already, as the operator made them; the operator's
    # applies and the autoscaler's then change them in place.
    spec, owner = parse_spec(body), Owner.from_body(body)
    assert (await cluster.post(DEPLOYMENTS, json=build_deployment(spec, owner))).status < 300
    assert (await cluster.post(SERVICES, json=build_service(spec, owner))).status < 300
    cluster.resources["policy/v1/poddisruptionbudgets"] = kmock.ResourceInfo(
        kind="PodDisruptionBudget", namespaced=True, verbs=VERBS
    )
    assert (await cluster.post(PDBS, json=build_pdb(spec, owner))).status < 300
    await create(cluster, body)
    deployment = await eventually(lambda: get(cluster, f"{DEPLOYMENTS}/llm"))
    assert deployment["spec"]["replicas"] == 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for index, host in enumerate(HOSTS):
        assert (await cluster.post(PODS, json=_pod(f"llm-{index}", host, port, labels))).status < 300

    async def idle_and_measured() -> bool:
        decision = await _decision(cluster)
        return decision.get("podsReady") == 2 and decision.get("podsUnknown") == 0 and decision.get("waiting") == 0

    await eventually(idle_and_measured, timeout=10)
    assert await _replicas(cluster) == 2

    # 1. A burst queues requests on both engines: scale up within a few ticks (scale-up window 0).
    loads = [_burst(host, port, 6) for host in HOSTS]
    started = time.monotonic()
    # Up to 3 or 4, depending on how much of the burst had queued at the tick; the first step is the only one
    # while its new pods are not ready (none ever come here: no controller runs in the emulator).
    await eventually(lambda: _scaled_above(cluster, 2), timeout=10)
    assert time.monotonic() - started < 10
    md = await get(cluster, f"{MD_PATH}/llm")
    assert md["status"]["desiredReplicas"] in (3, 4) and md["status"]["lastScaleTime"]

    # 2. The load ends; once the scale-down window has passed the replicas come back down.
    await asyncio.gather(*(asyncio.to_thread(load.join, 60) for load in loads))
    await eventually(lambda: _scaled_to(cluster, 2), timeout=15)

    # 3. Another burst scales up again; one engine dies mid-burst. Its pod is still Ready in the API (as it is
    #    until the kubelet's probe fails), its metrics are unknown: no scale-down, however long it lasts.
    loads = [_burst(host, port, 6) for host in HOSTS]
    await eventually(lambda: _scaled_above(cluster, 2), timeout=10)
    processes[1].kill()
    await asyncio.to_thread(loads[0].join, 60)
    # (the status keeps the metrics of the tick at which the decision last changed: waiting may still show the
    # queue the survivor had then)
    await eventually(lambda: _decision_is(cluster, podsUnknown=1, reason="MetricsUnknown"), timeout=10)
    scaled_down = len(await _events(cluster, "ScaledDown"))
    held = await _replicas(cluster)
    assert held > 2
    for _ in range(int((3 + 2) / 0.5)):  # longer than the scale-down window
        assert await _replicas(cluster) == held
        await asyncio.sleep(0.5)
    assert (await _decision(cluster))["reason"] == "MetricsUnknown"
    assert len(await _events(cluster, "ScaledDown")) == scaled_down

    # 4. Once the pod is reported not ready it leaves the average, and the replicas come down.
    await patch(cluster, f"{PODS}/llm-1/status", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    await eventually(lambda: _scaled_to(cluster, 2), timeout=15)

    ups = [e["message"] for e in await _events(cluster, "ScaledUp")]
    assert len(ups) == 2  # one action per burst: nothing more was ordered while the first was in flight
    assert (
        ups[0].startswith("ScaleUp: replicas 2 -> ") and "(waiting=" in ups[0] and "podsReady=2 podsUnknown=0" in ups[0]
    )
    final = "-> 2 (waiting=0 running=0 kvCacheUsage=0.00 podsReady=1 podsUnknown=0)"

    async def final_event() -> bool:  # kopf posts events in the background
        return any(e["message"].endswith(final) for e in await _events(cluster, "ScaledDown"))

    await eventually(final_event, timeout=5)


async def _scaled_to(emulator: kmock.KubernetesEmulator, replicas: int) -> bool:
    return await _replicas(emulator) == replicas


async def _scaled_above(emulator: kmock.KubernetesEmulator, replicas: int) -> bool:
    return await _replicas(emulator) > replicas


async def _decision_is(emulator: kmock.KubernetesEmulator, **expected: Any) -> bool:
    decision = await _decision(emulator)
    return all(decision.get(key) == value for key, value in expected.items())
