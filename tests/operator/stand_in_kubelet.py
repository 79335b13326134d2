"""A stand-in kubelet for the routing tests: each pod of a ModelDeployment runs here as a real `pagoda serve` at a
loopback address of its own (127.0.0.N, on the port the pod declares) and is reported Running and Ready at that IP,
so anything that reaches pods by ``status.podIP`` (the router, the autoscaler's scrape) reaches the real engine.

Volumes map to local folders; a ConfigMap volume gets the ConfigMap's keys as files, as the kubelet writes them.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Optional

from control_plane import Cluster, LocalPod, run_pod_locally

ENGINE_PORT = 8000


class StandInKubelet:
    """Runs the pods of the ModelDeployments it is asked to ``sync``; ``stop`` ends every engine it started."""

    def __init__(self, cluster: Cluster, directory: Path, first_ip: int = 10) -> None:
        self.cluster = cluster
        self.directory = directory
        self.pods: dict[str, LocalPod] = {}
        self.ips: dict[str, str] = {}
        self._next_ip = first_ip

    def sync(self, md: str) -> list[str]:
        """Start every pod of ``md`` that is not running yet; the names of the pods started."""
        started = []
        for pod in self.cluster.pods_of(md):
            name = pod["metadata"]["name"]
            if name not in self.pods:
                self._start(pod)
                started.append(name)
        return started

    def _start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        folder = self.directory / name
        volumes: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes") or []:
            local = folder / volume["name"]
            local.mkdir(parents=True, exist_ok=True)
            config_map = (volume.get("configMap") or {}).get("name")
            if config_map:
                for key, value in (
                    (self.cluster.get("configmap", config_map, self.cluster.namespace) or {}).get("data", {}).items()
                ):
                    (local / key).write_text(value)
            volumes[volume["name"]] = local
        # the machine's compiled kernels, not the pod's fresh cache folder (each pod would compile them again)
        extra_env = {"PAGODA_CACHE_DIR": str(Path.home() / ".cache" / "pagoda")}
        log = folder / "engine.log"
        self.pods[name] = run_pod_locally(
            self.cluster, self.cluster.namespace, pod["spec"], volumes, extra_env, log, host=ip, port=ENGINE_PORT
        )
        self.ips[name] = ip
        self.report(name, ready=True)

    def report(self, name: str, ready: bool) -> None:
        """Write the pod's status as the kubelet would: Running at its IP, Ready or not."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        value = "True" if ready else "False"
        conditions = [{"type": t, "status": value, "lastTransitionTime": now} for t in ("Ready", "ContainersReady")]
        ip = self.ips[name]
        status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "conditions": conditions}
        self.cluster.patch_pod_status(name, status)

    def terminate(self, name: str) -> None:
        """SIGTERM the pod's engine (it drains: /ready 503, in-flight requests finish, new ones 503)."""
        self.pods[name].server.process.send_signal(signal.SIGTERM)

    def metric(self, name: str, family: str) -> float:
        """The sum of a metric family's samples on the pod's own /metrics."""
        return self.pods[name].server.metric(family)

    def stop(self, name: Optional[str] = None) -> None:
        for pod_name in [name] if name else list(self.pods):
            process = self.pods.pop(pod_name).server.process
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(30)
            except Exception:
                process.kill()


def pod_annotations(cluster: Cluster, md: str) -> dict[str, str]:
    """The ModelDeployment's annotations ({} while it has none)."""
    body = cluster.get("modeldeployment", md, cluster.namespace) or {}
    return dict((body.get("metadata") or {}).get("annotations") or {})


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
