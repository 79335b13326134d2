"""The engine Deployment: args from the spec, probes, volumes, GPU resources, placement and a graceful drain.

Rollouts (``spec.rollout``) follow the Deployment's RollingUpdate, by default one surge pod and none unavailable:
a new pod must be Ready before an old one stops, so a one-replica model keeps serving through a spec change. A
stopping pod first sleeps in preStop (endpoints stop sending it traffic), then the engine drains its in-flight
requests for up to ``spec.drainSeconds`` (``--shutdown-timeout``); ``terminationGracePeriodSeconds`` covers both
plus a margin, so the kubelet never kills a draining engine.

Hub and S3 models are fetched by an init container (``pagoda download``, same image) into the model cache before
the engine starts, so the engine's startup probe never counts download time and the engine itself runs offline
(``PAGODA_OFFLINE=1``: only the cached files). Both containers report a failure as a one-line termination message
(``REASON: cause``), which the status turns into a ``Degraded`` reason. With LoRA on, the engine reads its adapter
list from a mounted ConfigMap (see ``builders.lora``) and may download adapters at any time, so it runs online.

Replicas rule (GitOps friendly): with autoscaling off, ``spec.replicas`` is part of every apply. With autoscaling
on, the autoscaler owns ``Deployment.spec.replicas``: the builder writes replicas only when the Deployment is created
(``include_replicas=True``, set to ``minReplicas``) and omits the field afterwards; the reconciler hands the field to
the autoscaler's field manager first (see ``reconcile._apply_deployment``), so a reconcile never undoes a scaling
decision and switching autoscaling on keeps the live replica count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

from pagoda_operator.builders.lora import lora_args, lora_volume
from pagoda_operator.builders.meta import Owner, child_labels, child_metadata, selector_labels
from pagoda_operator.builders.parallel import shm_size, tensor_parallel_env
from pagoda_operator.builders.routing import kv_events_args, kv_events_ports, routing_pod_labels
from pagoda_operator.builders.sources import PVC_MOUNT_ROOT, source_argument
from pagoda_operator.constants import ENGINE_PORT, PRESTOP_SLEEP_SECONDS
from pagoda_operator.spec import ModelDeploymentSpec

CACHE_MOUNT = "/var/cache/pagoda"
CHAT_TEMPLATE_MOUNT = "/etc/pagoda/chat-template"
# Extra seconds past preStop + the engine's drain time before the kubelet sends SIGKILL.
GRACE_MARGIN_SECONDS = 10


def model_arguments(spec: ModelDeploymentSpec) -> list[str]:
    """MODEL and --revision, as both ``pagoda download`` and ``pagoda serve`` take them."""
    if spec.model.kind == "builtin":
        return []
    return [source_argument(spec.model)] + (["--revision", spec.revision] if spec.revision else [])


def _flag(args: list[str], name: str, value: object) -> None:
    if value is not None:
        args += [name, str(value)]


def engine_args(spec: ModelDeploymentSpec) -> list[str]:
    """Arguments after ``pagoda serve``; vLLM-compatible flag names."""
    args = model_arguments(spec)
    args += ["--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--served-model-name", spec.served_model_name]
    if spec.task != "generate":  # generate is the engine's default: no flag, as for an unset field
        args += ["--task", spec.task]
    _flag(args, "--max-model-len", spec.max_model_len)
    _flag(args, "--max-num-seqs", spec.max_num_seqs)
    _flag(args, "--gpu-memory-utilization", spec.gpu_memory_utilization)
    _flag(args, "--dtype", spec.dtype)
    if spec.enable_prefix_caching is not None:
        args.append("--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching")
    if spec.gpus > 0:
        args += ["--tensor-parallel-size", str(spec.gpus)]
    _flag(args, "--quantization", spec.quantization)
    if spec.kv_cache_dtype not in (None, "auto"):  # auto is the engine's default: no flag, as for an unset field
        args += ["--kv-cache-dtype", spec.kv_cache_dtype]
    args += lora_args(spec)
    template = spec.chat_template
    if template is not None:
        args += ["--chat-template", template.inline or f"{CHAT_TEMPLATE_MOUNT}/{template.config_map.key}"]
    args += ["--shutdown-timeout", str(spec.drain_seconds)]
    args += kv_events_args(spec)  # spec.routing.kvEvents (builders.routing)
    return args + list(spec.extra_args)


def _volumes(spec: ModelDeploymentSpec, owner: Owner) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # shm: PyTorch and NCCL use /dev/shm, whose container default (64Mi) is far too small; with gpus: N it is sized
    # for N workers unless spec.shmSize says otherwise (see builders.parallel).
    shm = {"medium": "Memory", "sizeLimit": shm_size(spec.shm_size, spec.gpus)}
    volumes: list[dict[str, Any]] = [{"name": "shm", "emptyDir": shm}]
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"}]
    cache = spec.model_cache
    if cache.type == "pvc":
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}})
    else:
        volumes.append({"name": "model-cache", "emptyDir": {"sizeLimit": cache.size} if cache.size else {}})
    mounts.append({"name": "model-cache", "mountPath": CACHE_MOUNT})
    for index, claim in enumerate(spec.pvc_claims()):
        name = f"pvc-{index}"
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": name, "mountPath": f"{PVC_MOUNT_ROOT}/{claim}", "readOnly": True})
    template = spec.chat_template
    if template is not None and template.config_map is not None:
        ref = template.config_map
        volumes.append(
            {"name": "chat-template", "configMap": {"name": ref.name, "items": [{"key": ref.key, "path": ref.key}]}}
        )
        mounts.append({"name": "chat-template", "mountPath": CHAT_TEMPLATE_MOUNT, "readOnly": True})
    lora = lora_volume(spec, owner)
    if lora is not None:
        volumes.append(lora[0])
        mounts.append(lora[1])
    return volumes, mounts


def _source_env(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """Where models are cached and how to reach their source: what the downloader and the engine share."""
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
        # downloaded S3 models and the engine's compiled CPU kernels (per CPU model) live on the cache volume too
        {"name": "PAGODA_CACHE_DIR", "value": CACHE_MOUNT},
    ]
    if spec.hf_token is not None:
        ref = {"name": spec.hf_token.name, "key": spec.hf_token.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    if spec.s3.endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": spec.s3.endpoint_url})
    if spec.s3.region:
        env.append({"name": "AWS_REGION", "value": spec.s3.region})
    return env


def _env(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    env = _source_env(spec)
    if spec.model.downloaded:  # the init container fetched the model: no network for it at start
        env.append({"name": "PAGODA_OFFLINE", "value": "1"})
    if spec.lora_enabled:  # but the engine downloads Hub and S3 adapters itself whenever the list changes
        env.append({"name": "PAGODA_LORA_OFFLINE", "value": "0"})
    threads = cpu_threads(spec.resources)
    user_names = {item.get("name") for item in spec.env}
    if threads is not None and "OMP_NUM_THREADS" not in user_names:
        # torch sizes its thread pool from the node's cores, not the container's CPU limit: 64 threads fighting
        # over a 2-CPU quota are far slower than 2.
        env.append({"name": "OMP_NUM_THREADS", "value": str(threads)})
    if spec.api_key_secret_name:
        ref = {"name": spec.api_key_secret_name, "key": spec.api_key_secret_key}
        env.append({"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": ref}})
    env += tensor_parallel_env(spec.gpus, spec.env)  # NCCL and gloo settings for N workers in one pod
    return env + [dict(item) for item in spec.env]


def cpu_threads(resources: Mapping[str, Any]) -> Optional[int]:
    """Whole CPUs of the container's CPU limit, rounded up (at least 1); None without a limit."""
    limit = (resources.get("limits") or {}).get("cpu")
    if limit is None:
        return None
    text = str(limit)
    cpus = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    return max(1, math.ceil(cpus))


def _env_from(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    secret = spec.s3.credentials_secret
    return [{"secretRef": {"name": secret}}] if secret else []  # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...


def _resources(spec: ModelDeploymentSpec) -> dict[str, Any]:
    requests = dict(spec.resources.get("requests") or {})
    limits = dict(spec.resources.get("limits") or {})
    if spec.gpus > 0:
        # Extended resources must have requests == limits; setting both keeps that true.
        limits["nvidia.com/gpu"] = spec.gpus
        requests["nvidia.com/gpu"] = spec.gpus
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 3,
    }


_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def _pagoda_container(
    spec: ModelDeploymentSpec, name: str, command: str, args: list[str], env: list[dict[str, Any]]
) -> dict[str, Any]:
    """A container of the engine image running ``pagoda COMMAND ARGS``: what the engine and the model download
    share (image, termination message, security context, the S3 credentials Secret)."""
    container: dict[str, Any] = {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["pagoda", command],
        "args": args,
        "env": env,
        # Both write "REASON: cause" there when they cannot start; without it, the last lines of their log.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": dict(_SECURITY_CONTEXT),
    }
    if _env_from(spec):
        container["envFrom"] = _env_from(spec)
    return container


def _container(spec: ModelDeploymentSpec, owner: Owner) -> dict[str, Any]:
    container = _pagoda_container(spec, "engine", "serve", engine_args(spec), _env(spec))
    container.update(
        ports=[{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}, *kv_events_ports(spec)],
        resources=_resources(spec),
        volumeMounts=_volumes(spec, owner)[1],
        # Loading a large model may take many minutes: the startup probe allows 30 of them before liveness counts.
        startupProbe=_probe("/ready", 10, 180),
        readinessProbe=_probe("/ready", 5, 3),
        livenessProbe=_probe("/health", 10, 3),
        lifecycle={"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
    )
    return container


def _download_container(spec: ModelDeploymentSpec) -> dict[str, Any]:
    """``pagoda download`` into the model cache: once per cache volume (a shared claim is filled once)."""
    resources = {
        kind: {k: v for k, v in values.items() if k != "nvidia.com/gpu"} for kind, values in _resources(spec).items()
    }
    container = _pagoda_container(spec, "model-download", "download", model_arguments(spec), _source_env(spec))
    container.update(
        resources={k: v for k, v in resources.items() if v},
        volumeMounts=[{"name": "model-cache", "mountPath": CACHE_MOUNT}],
    )
    return container


def grace_period_seconds(spec: ModelDeploymentSpec) -> int:
    """The pod's ``terminationGracePeriodSeconds``: preStop sleep, then the engine's drain, then a margin."""
    return PRESTOP_SLEEP_SECONDS + spec.drain_seconds + GRACE_MARGIN_SECONDS


def _pod_spec(spec: ModelDeploymentSpec, owner: Owner) -> dict[str, Any]:
    tolerations = [dict(t) for t in spec.tolerations]
    if spec.gpus > 0 and not any(t.get("key") == "nvidia.com/gpu" for t in tolerations):
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    pod: dict[str, Any] = {
        "containers": [_container(spec, owner)],
        **({"initContainers": [_download_container(spec)]} if spec.model.downloaded else {}),
        "volumes": _volumes(spec, owner)[0],
        "terminationGracePeriodSeconds": grace_period_seconds(spec),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if tolerations:
        pod["tolerations"] = tolerations
    if spec.affinity:
        pod["affinity"] = dict(spec.affinity)
    return pod


def build_deployment(spec: ModelDeploymentSpec, owner: Owner, *, include_replicas: bool = True) -> dict[str, Any]:
    """The engine Deployment. See the module docstring for when ``include_replicas`` may be False."""
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(owner)},
        # CPU and GPU alike: surge first by default (see the module docstring); spec.rollout trades that for
        # needing no spare capacity (maxSurge 0, maxUnavailable 1).
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": spec.rollout.max_surge, "maxUnavailable": spec.rollout.max_unavailable},
        },
        # the pod template may carry more labels than the selector (endpoint pickers read them), never fewer
        "template": {
            "metadata": {"labels": {**child_labels(owner), **routing_pod_labels(spec)}},
            "spec": _pod_spec(spec, owner),
        },
    }
    if spec.autoscaling.enabled:
        if include_replicas:
            deployment_spec["replicas"] = spec.autoscaling.min_replicas
    else:
        deployment_spec["replicas"] = spec.replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": child_metadata(owner), "spec": deployment_spec}


def replicas_apply(owner: Owner, replicas: int) -> dict[str, Any]:
    """A server-side apply of the Deployment's ``spec.replicas`` alone: what the autoscaler's field manager owns
    (the reconciler hands the field over with it, the autoscaler scales with it)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": owner.name, "namespace": owner.namespace},
        "spec": {"replicas": replicas},
    }
