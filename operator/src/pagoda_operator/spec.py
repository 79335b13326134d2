"""Parse a ModelDeployment body once into a frozen, validated ``ModelDeploymentSpec``.

The CRD's OpenAPI schema already enforces types, enums, minimums and defaults. This module checks what the schema
cannot express (cross-field rules, the shape of ``pvc://`` sources, duplicate adapter names), mirrors its CEL rules
(but the one on quantization with tensor parallelism, which follows the engine's contract: ``capabilities.py``),
and raises ``InvalidSpec`` naming the offending field, so the operator can report it in a Degraded condition.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from pagoda_operator.constants import DEFAULT_ENGINE_IMAGE
from pagoda_operator.spec_errors import InvalidSpec as InvalidSpec  # re-exported: callers import it from here
from pagoda_operator.spec_routing import KedaSettings, Routing, check_scaling_mode, parse_keda, parse_routing

# The CRD's CEL rule: the engine's weight-only int8 kernels are CPU kernels. Which method is served on which device
# and which cannot be sharded over tensor-parallel workers is the engine's contract (capabilities.py), not this file.
CPU_ONLY_QUANTIZATIONS = frozenset({"int8"})
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# The engine's rule for adapter names (pagoda.lora.sources), also the CRD's pattern.
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
LORA_RANKS = (8, 16, 32, 64, 128, 256)  # what --max-lora-rank takes
ENGINE_DEFAULT_MAX_LORAS = 4  # pagoda serve's --max-loras default, which --max-cpu-loras must not undercut
_PVC_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_S3_URL = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$")
_PERCENT = re.compile(r"^(0|[1-9][0-9]*)%$")  # the CRD's pattern for rollout percentages
DEFAULT_DRAIN_SECONDS = 30
TASKS = ("generate", "embed", "score")  # spec.task: the engine's --task (embed, score: pooling models, no LoRA)


@dataclass(slots=True, frozen=True)
class ModelSource:
    """Where weights come from: ``kind`` is ``builtin``, ``hf`` (a Hugging Face id), ``s3``, ``pvc`` or ``path``."""

    kind: str
    value: str  # the HF id, the s3:// URL, the absolute path inside the image, or the path inside the claim
    claim: Optional[str] = None  # only for kind == "pvc"

    @property
    def downloaded(self) -> bool:
        """Whether the files are fetched into the model cache before the engine starts (Hub and S3 models)."""
        return self.kind in ("hf", "s3")


@dataclass(slots=True, frozen=True)
class SecretKey:
    """One key of a Secret."""

    name: str
    key: str


@dataclass(slots=True, frozen=True)
class S3Settings:
    """Where an s3:// source is read from; credentials from a Secret's AWS_* keys, else the pod's identity."""

    endpoint_url: Optional[str] = None
    region: Optional[str] = None
    credentials_secret: Optional[str] = None


@dataclass(slots=True, frozen=True)
class ChatTemplate:
    """A chat template given inline, or as one key of a ConfigMap (mounted as a file)."""

    inline: Optional[str] = None
    config_map: Optional[SecretKey] = None  # (name, key) of the ConfigMap


@dataclass(slots=True, frozen=True)
class LoraAdapter:
    """One LoRA adapter served next to the base model under its own name."""

    name: str
    source: ModelSource


@dataclass(slots=True, frozen=True)
class Autoscaling:
    """Autoscaling settings; with ``enabled`` the autoscaler, not ``spec.replicas``, owns the replica count."""

    enabled: bool = False
    mode: str = "builtin"
    min_replicas: int = 1
    max_replicas: int = 1
    target_waiting_requests: float = 5.0
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    keda: KedaSettings = field(default_factory=KedaSettings)  # mode keda's ScaledObject (spec_routing)


@dataclass(slots=True, frozen=True)
class Rollout:
    """How a spec change replaces the pods: the Deployment's RollingUpdate, each an int or a percent string.

    The default starts a new pod before stopping an old one, so a one-replica model keeps serving through a
    rollout when the cluster has room for one more pod (for a GPU model: a spare GPU)."""

    max_surge: int | str = 1
    max_unavailable: int | str = 0


@dataclass(slots=True, frozen=True)
class ModelCache:
    """Where downloaded weights are cached: a PVC (survives restarts) or an emptyDir (per pod)."""

    type: str = "emptyDir"
    claim_name: Optional[str] = None
    size: Optional[str] = None


@dataclass(slots=True, frozen=True)
class ModelDeploymentSpec:
    """The validated spec of one ModelDeployment. Built only by ``parse_spec``."""

    model: ModelSource
    served_model_name: str
    task: str = "generate"
    revision: Optional[str] = None
    hf_token: Optional[SecretKey] = None
    s3: S3Settings = field(default_factory=S3Settings)
    chat_template: Optional[ChatTemplate] = None
    image: str = DEFAULT_ENGINE_IMAGE
    image_pull_policy: str = "IfNotPresent"
    extra_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    drain_seconds: int = DEFAULT_DRAIN_SECONDS  # the engine's --shutdown-timeout; the grace period follows it
    gpus: int = 0
    quantization: Optional[str] = None
    kv_cache_dtype: Optional[str] = None  # spec.kvCacheDtype as given; unset or auto: the model's dtype
    max_model_len: Optional[int] = None
    dtype: Optional[str] = None
    gpu_memory_utilization: Optional[float] = None
    max_num_seqs: Optional[int] = None
    enable_prefix_caching: Optional[bool] = None
    # LoRA is on whenever spec.loraAdapters is present, even empty: then the adapter list can change (to and
    # from empty too) without touching the pod template.
    lora_enabled: bool = False
    lora_adapters: tuple[LoraAdapter, ...] = ()
    max_loras: Optional[int] = None
    max_lora_rank: Optional[int] = None
    max_cpu_loras: Optional[int] = None
    replicas: int = 1
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    rollout: Rollout = field(default_factory=Rollout)
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Optional[Mapping[str, Any]] = None
    api_key_secret_name: Optional[str] = None
    api_key_secret_key: str = "api-key"
    model_cache: ModelCache = field(default_factory=ModelCache)
    shm_size: Optional[str] = None  # spec.shmSize as given; unset: sized from gpus (builders.parallel)
    service_type: str = "ClusterIP"
    service_port: int = 8000
    routing: Routing = field(default_factory=Routing)  # spec.routing (spec_routing)

    @property
    def min_replicas(self) -> int:
        """The fewest replicas this resource runs with: ``replicas``, or ``minReplicas`` while autoscaled."""
        return self.autoscaling.min_replicas if self.autoscaling.enabled else self.replicas

    def pvc_claims(self) -> list[str]:
        """Distinct claims that hold the model or an adapter: the model's first, then the adapters' by name.

        Sorted, not in list order, so reordering adapters never renames a volume (which would roll the pods)."""
        model = [self.model.claim] if self.model.kind == "pvc" and self.model.claim else []
        adapters = sorted({a.source.claim for a in self.lora_adapters if a.source.kind == "pvc" and a.source.claim})
        return model + [claim for claim in adapters if claim not in model]


def parse_source(text: Optional[str], field_path: str) -> ModelSource:
    """Parse ``pvc://claim/path``, an absolute path inside the image, or a Hugging Face id (optionally ``hf://``)."""
    if not text:
        return ModelSource(kind="builtin", value="")
    if text.startswith("pvc://"):
        claim, _, path = text[len("pvc://") :].partition("/")
        if not claim or not _PVC_NAME.match(claim):
            raise InvalidSpec(field_path, f"{text!r}: expected pvc://<claim>/<path> with a valid claim name")
        if not path.strip("/") or ".." in path.split("/"):
            raise InvalidSpec(field_path, f"{text!r}: expected pvc://<claim>/<path> with a path inside the claim")
        return ModelSource(kind="pvc", value=path.strip("/"), claim=claim)
    if text.startswith("/"):
        return ModelSource(kind="path", value=text)
    if text.startswith("s3://"):
        if not _S3_URL.match(text):
            raise InvalidSpec(field_path, f"{text!r}: expected s3://<bucket>/<prefix>")
        if {".", ".."} & set(text[len("s3://") :].replace("\\", "/").split("/")):  # the engine refuses them too
            raise InvalidSpec(field_path, f"{text!r}: an s3:// prefix may not hold '.' or '..' path segments")
        return ModelSource(kind="s3", value=text.rstrip("/"))
    hf_id = text[len("hf://") :] if text.startswith("hf://") else text
    if not _HF_ID.match(hf_id):
        raise InvalidSpec(field_path, f"{text!r} is neither pvc://claim/path, an absolute path, nor a Hugging Face id")
    return ModelSource(kind="hf", value=hf_id)


def _parse_autoscaling(raw: Mapping[str, Any]) -> Autoscaling:
    scaling = Autoscaling(
        enabled=bool(raw.get("enabled", False)),
        mode=str(raw.get("mode", "builtin")),
        min_replicas=int(raw.get("minReplicas", 1)),
        max_replicas=int(raw.get("maxReplicas", max(1, int(raw.get("minReplicas", 1))))),
        target_waiting_requests=float(raw.get("targetWaitingRequests", 5)),
        scale_up_stabilization_seconds=int(raw.get("scaleUpStabilizationSeconds", 0)),
        scale_down_stabilization_seconds=int(raw.get("scaleDownStabilizationSeconds", 300)),
        keda=parse_keda(raw, str(raw.get("mode", "builtin")), bool(raw.get("enabled", False))),
    )
    check_scaling_mode(scaling.mode, scaling.enabled, scaling.min_replicas)
    if scaling.enabled and scaling.min_replicas > scaling.max_replicas:
        raise InvalidSpec(
            "spec.autoscaling.minReplicas",
            f"minReplicas ({scaling.min_replicas}) is greater than maxReplicas ({scaling.max_replicas})",
        )
    if scaling.target_waiting_requests <= 0:
        raise InvalidSpec("spec.autoscaling.targetWaitingRequests", "must be greater than 0")
    return scaling


def _rollout_value(raw: Mapping[str, Any], key: str, default: int, at_most_100: bool) -> int | str:
    """One RollingUpdate bound: a count >= 0 or a percentage (the CRD's schema, checked again for bodies that did
    not pass an API server)."""
    value = raw.get(key, default)
    if isinstance(value, str) and _PERCENT.match(value):
        if at_most_100 and int(value[:-1]) > 100:
            raise InvalidSpec(f"spec.rollout.{key}", f"{value} is more than 100%")
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise InvalidSpec(f"spec.rollout.{key}", f"{value!r} is neither a count >= 0 nor a percentage such as 25%")


def _parse_rollout(raw: Mapping[str, Any]) -> Rollout:
    """The rollout bounds (mirrors the CRD's CEL rule: not both zero, or a rollout could never make progress)."""
    rollout = Rollout(
        max_surge=_rollout_value(raw, "maxSurge", 1, at_most_100=False),
        max_unavailable=_rollout_value(raw, "maxUnavailable", 0, at_most_100=True),
    )
    if rollout.max_surge in (0, "0%") and rollout.max_unavailable in (0, "0%"):
        raise InvalidSpec("spec.rollout", "maxSurge and maxUnavailable are both 0: set maxUnavailable to 1")
    return rollout


def _parse_drain(spec: Mapping[str, Any], engine: Mapping[str, Any]) -> int:
    """``spec.drainSeconds``; the older ``engine.shutdownTimeoutSeconds`` still counts when it is the only one set
    (the CRD used to default it, so stored resources carry it: refusing both would refuse their next edit)."""
    drain = spec.get("drainSeconds")
    if drain is None:
        drain = engine.get("shutdownTimeoutSeconds", DEFAULT_DRAIN_SECONDS)
    return int(drain)


def _parse_adapters(raw: list[Mapping[str, Any]]) -> tuple[LoraAdapter, ...]:
    adapters: list[LoraAdapter] = []
    seen: set[str] = set()
    for index, item in enumerate(raw):
        name = str(item.get("name", ""))
        path = f"spec.loraAdapters[{index}]"
        if not _ADAPTER_NAME.match(name):
            raise InvalidSpec(f"{path}.name", f"{name!r} is not a valid adapter name")
        if name in seen:
            raise InvalidSpec(f"{path}.name", f"adapter name {name!r} is used more than once")
        seen.add(name)
        source = parse_source(item.get("source"), f"{path}.source")
        if source.kind == "builtin":
            raise InvalidSpec(f"{path}.source", "an adapter needs a source")
        adapters.append(LoraAdapter(name=name, source=source))
    return tuple(adapters)


def _parse_lora(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The LoRA fields (mirrors the CRD's CEL rules on them)."""
    enabled = spec.get("loraAdapters") is not None
    for key in ("maxLoras", "maxLoraRank", "maxCpuLoras"):
        if spec.get(key) is not None and not enabled:
            raise InvalidSpec(f"spec.{key}", "set only together with loraAdapters")
    rank = spec.get("maxLoraRank")
    if rank is not None and rank not in LORA_RANKS:
        raise InvalidSpec("spec.maxLoraRank", f"{rank} is not one of {', '.join(map(str, LORA_RANKS))}")
    max_loras, max_cpu_loras = spec.get("maxLoras"), spec.get("maxCpuLoras")
    resident = ENGINE_DEFAULT_MAX_LORAS if max_loras is None else max_loras
    if max_cpu_loras is not None and max_cpu_loras < resident:
        raise InvalidSpec("spec.maxCpuLoras", f"{max_cpu_loras} is less than maxLoras ({resident})")
    return {
        "lora_enabled": enabled,
        "lora_adapters": _parse_adapters(list(spec.get("loraAdapters") or [])),
        "max_loras": max_loras,
        "max_lora_rank": rank,
        "max_cpu_loras": max_cpu_loras,
    }


def _parse_cache(raw: Mapping[str, Any]) -> ModelCache:
    cache = ModelCache(type=str(raw.get("type", "emptyDir")), claim_name=raw.get("claimName"), size=raw.get("size"))
    if cache.type == "pvc" and not cache.claim_name:
        raise InvalidSpec("spec.modelCache.claimName", "required when modelCache.type is pvc")
    return cache


def _parse_model(model: Mapping[str, Any], s3_adapters: bool) -> dict[str, Any]:
    """The model's source and how to fetch it (mirrors the CRD's CEL rules on spec.model); ``s3_adapters``:
    whether an adapter comes from S3 (it is read with the same S3 settings)."""
    source = parse_source(model.get("source"), "spec.model.source")
    revision = model.get("revision")
    if revision is not None and source.kind != "hf":
        raise InvalidSpec("spec.model.revision", "applies to Hugging Face sources only")
    raw_s3 = model.get("s3")
    if raw_s3 is not None and source.kind != "s3" and not s3_adapters:
        raise InvalidSpec("spec.model.s3", "applies to s3:// sources (the model's or an adapter's) only")
    raw_s3 = raw_s3 or {}
    token = model.get("hfTokenSecretRef")
    return {
        "model": source,
        "revision": revision,
        "hf_token": SecretKey(token["name"], str(token.get("key", "token"))) if token else None,
        "s3": S3Settings(
            endpoint_url=raw_s3.get("endpointUrl"),
            region=raw_s3.get("region"),
            credentials_secret=(raw_s3.get("credentialsSecretRef") or {}).get("name"),
        ),
    }


def _parse_chat_template(raw: Optional[Mapping[str, Any]]) -> Optional[ChatTemplate]:
    if raw is None:
        return None
    ref = raw.get("configMapKeyRef")
    if (raw.get("inline") is None) == (ref is None):
        raise InvalidSpec("spec.engine.chatTemplate", "set exactly one of inline and configMapKeyRef")
    return ChatTemplate(inline=raw.get("inline"), config_map=SecretKey(ref["name"], ref["key"]) if ref else None)


def parse_spec(body: Mapping[str, Any]) -> ModelDeploymentSpec:
    """Validate and freeze ``body['spec']``; raises ``InvalidSpec`` naming the first bad field."""
    spec = body.get("spec") or {}
    name = str((body.get("metadata") or {}).get("name", ""))
    model = spec.get("model") or {}
    engine = spec.get("engine") or {}
    gpus = int(spec.get("gpus", 0))
    quantization = spec.get("quantization")
    if quantization in CPU_ONLY_QUANTIZATIONS and gpus > 0:
        raise InvalidSpec("spec.quantization", f"{quantization} runs on CPU replicas only, but spec.gpus is {gpus}")
    lora = _parse_lora(spec)
    task = str(spec.get("task", "generate"))
    if task not in TASKS or (task != "generate" and lora["lora_enabled"]):
        raise InvalidSpec("spec.task", f"{task!r}: one of {', '.join(TASKS)}; loraAdapters need task generate")
    s3_adapters = any(a.source.kind == "s3" for a in lora["lora_adapters"])
    api_key = spec.get("apiKeySecretRef") or {}
    service = spec.get("service") or {}
    return ModelDeploymentSpec(
        **_parse_model(model, s3_adapters),
        **lora,
        served_model_name=str(model.get("servedModelName") or name),
        task=task,
        chat_template=_parse_chat_template(engine.get("chatTemplate")),
        image=str(engine.get("image") or DEFAULT_ENGINE_IMAGE),
        image_pull_policy=str(engine.get("imagePullPolicy", "IfNotPresent")),
        extra_args=tuple(str(a) for a in engine.get("extraArgs") or ()),
        env=tuple(engine.get("env") or ()),
        drain_seconds=_parse_drain(spec, engine),
        gpus=gpus,
        quantization=quantization,
        kv_cache_dtype=spec.get("kvCacheDtype"),
        max_model_len=spec.get("maxModelLen"),
        dtype=spec.get("dtype"),
        gpu_memory_utilization=spec.get("gpuMemoryUtilization"),
        max_num_seqs=spec.get("maxNumSeqs"),
        enable_prefix_caching=spec.get("enablePrefixCaching"),
        replicas=int(spec.get("replicas", 1)),
        autoscaling=_parse_autoscaling(spec.get("autoscaling") or {}),
        rollout=_parse_rollout(spec.get("rollout") or {}),
        resources=dict(spec.get("resources") or {}),
        node_selector=dict(spec.get("nodeSelector") or {}),
        tolerations=tuple(spec.get("tolerations") or ()),
        affinity=spec.get("affinity"),
        api_key_secret_name=api_key.get("name"),
        api_key_secret_key=str(api_key.get("key", "api-key")),
        model_cache=_parse_cache(spec.get("modelCache") or {}),
        shm_size=str(spec["shmSize"]) if spec.get("shmSize") is not None else None,
        service_type=str(service.get("type", "ClusterIP")),
        service_port=int(service.get("port", 8000)),
        routing=parse_routing(spec.get("routing"), spec.get("enablePrefixCaching")),
    )
