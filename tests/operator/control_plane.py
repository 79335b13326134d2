"""A real Kubernetes control plane for tests (``../shared/k8s/cluster``: etcd, kube-apiserver and
kube-controller-manager v1.24, no scheduler and no kubelet), the operator running against it, and a stand-in kubelet
that runs a rendered pod's containers here as local processes.

``run_pod_locally`` is what makes "the API server accepted it, so it serves" checkable without a kubelet: the pod's
init containers run to completion, then its engine container's command line starts as a local `pagoda serve`, with
the pod's environment (Secrets resolved from the cluster) and its volumes mapped to local folders.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO.parent / "shared" / "k8s" / "cluster"
sys.path.insert(0, str(REPO / "e2e"))
sys.path.insert(0, str(REPO / "tests" / "engine"))

from server_helpers import Server, free_port  # noqa: E402  (tests/engine/)

from cluster_tools import tool  # noqa: E402  (e2e/: kubectl from PATH or from the layer package)


@dataclass
class Cluster:
    """A running control plane; ``kubectl`` talks to it."""

    directory: Path
    kubeconfig: str

    def kubectl(self, *args: str, stdin: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": self.kubeconfig}
        result = subprocess.run(
            [tool("kubectl"), *args], input=stdin, env=env, capture_output=True, text=True, timeout=120
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def get(self, kind: str, name: str, namespace: str) -> Optional[dict[str, Any]]:
        result = self.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def secret_data(self, name: str, namespace: str) -> dict[str, str]:
        secret = self.get("secret", name, namespace) or {}
        return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


@contextmanager
def control_plane(directory: Path) -> Iterator[Cluster]:
    """Start the control plane in ``directory`` and stop it afterwards."""
    started = subprocess.run(
        [str(CLUSTER_SCRIPT), "start", str(directory)], capture_output=True, text=True, timeout=180
    )
    if started.returncode != 0:
        raise RuntimeError(f"the control plane did not start: {started.stderr[-2000:]}")
    kubeconfig = started.stdout.strip().rsplit("=", 1)[-1]
    try:
        yield Cluster(directory, kubeconfig)
    finally:
        subprocess.run([str(CLUSTER_SCRIPT), "stop", str(directory)], capture_output=True, timeout=60)


@contextmanager
def cluster_with_crd(directory: Path, namespace: str) -> Iterator[Cluster]:
    """The control plane with the ModelDeployment CRD established and ``namespace`` created."""
    with control_plane(directory) as cluster:
        cluster.kubectl("apply", "-f", str(REPO / "crds" / "modeldeployment.yaml"))
        cluster.kubectl("wait", "--for", "condition=established", "crd/modeldeployments.pagoda.dev", "--timeout=60s")
        cluster.kubectl("create", "namespace", namespace)
        yield cluster


@contextmanager
def running_operator(
    cluster: Cluster, namespace: str, log: Path, extra_env: Optional[dict[str, str]] = None
) -> Iterator[subprocess.Popen]:
    """The operator (``kopf run``, standalone, watching ``namespace``) as a process against the cluster;
    ``extra_env`` adds to its environment (e.g. ``PAGODA_AUTOSCALE_INTERVAL``)."""
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "PAGODA_RECONCILE_INTERVAL": "2", **(extra_env or {})}
    command = [sys.executable, "-m", "kopf", "run", "--standalone", "-n", namespace, "-m", "pagoda_operator.main"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60) -> Any:
    """``probe()`` until it returns something truthy; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class LocalPod:
    """A rendered pod run here: its server, and the folders its volumes were mapped to."""

    server: Server
    mounts: dict[str, Path]


def run_pod_locally(
    cluster: Cluster,
    namespace: str,
    pod: dict[str, Any],
    volumes: dict[str, Path],
    extra_env: dict[str, str],
    log: Path,
) -> LocalPod:
    """Run ``pod``'s init containers, then start its engine container as a local server (ready).

    ``volumes`` maps a volume name of the pod to a local folder; ``/dev/shm`` stays the machine's. ``--host`` and
    ``--port`` are replaced by 127.0.0.1 and a free port (the pod's network); ``extra_env`` is added (HF_ENDPOINT,
    which the pod would not need in a cluster with internet access).
    """
    mounts = _mount_map(pod, volumes)
    for container in pod.get("initContainers") or []:
        command, env = _command_and_env(cluster, namespace, container, mounts, extra_env)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"init container {container['name']} failed: {result.stderr[-3000:]}"
    (engine,) = pod["containers"]
    command, env = _command_and_env(cluster, namespace, engine, mounts, extra_env)
    port = free_port()
    command = _replace_flag(_replace_flag(command, "--host", "127.0.0.1"), "--port", str(port))
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    server = Server(process, port, str(log))
    wait_for(f"the engine of {pod.get('metadata', {}).get('name', 'the pod')} to be ready", lambda: _ready(server), 180)
    return LocalPod(server, mounts)


def _ready(server: Server) -> bool:
    if server.process.poll() is not None:
        raise AssertionError(f"the engine exited with {server.process.returncode}: {server.log()[-3000:]}")
    try:
        return server.request("GET", "/ready")[0] == 200
    except OSError:
        return False


def _mount_map(pod: dict[str, Any], volumes: dict[str, Path]) -> dict[str, Path]:
    """Container mount path -> local folder, for every mount of every container (shm excepted)."""
    by_volume = {v["name"]: v for v in pod.get("volumes") or []}
    mounts: dict[str, Path] = {}
    for container in [*(pod.get("initContainers") or []), *pod["containers"]]:
        for mount in container.get("volumeMounts") or []:
            if mount["mountPath"] == "/dev/shm":
                continue
            assert mount["name"] in volumes, f"no local folder for volume {mount['name']}: {by_volume[mount['name']]}"
            mounts[mount["mountPath"]] = volumes[mount["name"]]
    return mounts


def _command_and_env(
    cluster: Cluster, namespace: str, container: dict[str, Any], mounts: dict[str, Path], extra: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    command = [*container["command"], *container.get("args", ())]
    assert command[0] == "pagoda", command
    command = [sys.executable, "-m", "pagoda.cli", *(_local_path(arg, mounts) for arg in command[1:])]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PAGODA_", "AWS_", "OMP_"))}
    for source in container.get("envFrom") or []:
        env.update(cluster.secret_data(source["secretRef"]["name"], namespace))
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = _local_path(item["value"], mounts)
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = cluster.secret_data(ref["name"], namespace)[ref["key"]]
    return command, {**env, **extra}


def _local_path(value: str, mounts: dict[str, Path]) -> str:
    for mount_path, local in sorted(mounts.items(), key=lambda item: -len(item[0])):
        if value == mount_path or value.startswith(mount_path + "/"):
            return str(local) + value[len(mount_path) :]
    return value


def _replace_flag(command: list[str], flag: str, value: str) -> list[str]:
    index = command.index(flag)
    return [*command[: index + 1], value, *command[index + 2 :]]
