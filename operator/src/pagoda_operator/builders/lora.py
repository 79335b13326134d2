"""LoRA adapter delivery: the adapter list ConfigMap, and the volume and flags that let the engine read it.

The adapter list is never part of the pod template. It lives in a ConfigMap (``<name>-lora-adapters``, key
``adapters.json``: ``[{"name": ..., "path": ...}]`` with each path as the engine sees it) that is mounted as a
directory into the engine container; the engine re-reads the file every few seconds (``--lora-modules-file``),
loading added adapters and unloading removed ones. So a change of ``spec.loraAdapters`` rewrites the ConfigMap
only: the kubelet refreshes the mounted file and the running pods follow, without a rollout, and a pod that starts
later reads the current list. (A ``subPath`` mount would never see an update; a directory mount does.)
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pagoda_operator.builders.meta import Owner, child_metadata
from pagoda_operator.builders.sources import source_argument
from pagoda_operator.spec import ModelDeploymentSpec

LORA_MOUNT = "/etc/pagoda/lora"
ADAPTERS_KEY = "adapters.json"
LORA_VOLUME = "lora-adapters"


def lora_config_map_name(owner: Owner) -> str:
    """The adapter list ConfigMap's name (the Deployment and Service take the resource's own name)."""
    return f"{owner.name}-lora-adapters"


def adapter_list(spec: ModelDeploymentSpec) -> list[dict[str, str]]:
    """The engine's adapter list: each adapter's name and its source as the engine reads it."""
    return [{"name": a.name, "path": source_argument(a.source)} for a in spec.lora_adapters]


def build_lora_config_map(spec: ModelDeploymentSpec, owner: Owner) -> Optional[dict[str, Any]]:
    """The ConfigMap holding ``adapters.json``, or None when LoRA is off (no ``spec.loraAdapters``)."""
    if not spec.lora_enabled:
        return None
    metadata = {**child_metadata(owner), "name": lora_config_map_name(owner)}
    content = json.dumps(adapter_list(spec), indent=2) + "\n"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {ADAPTERS_KEY: content}}


def lora_args(spec: ModelDeploymentSpec) -> list[str]:
    """The engine's LoRA flags: the same for every adapter list, so that a list change leaves the pods alone."""
    if not spec.lora_enabled:
        return []
    args = ["--enable-lora", "--lora-modules-file", f"{LORA_MOUNT}/{ADAPTERS_KEY}"]
    for flag, value in (
        ("--max-loras", spec.max_loras),
        ("--max-lora-rank", spec.max_lora_rank),
        ("--max-cpu-loras", spec.max_cpu_loras),
    ):
        if value is not None:
            args += [flag, str(value)]
    return args


def lora_volume(spec: ModelDeploymentSpec, owner: Owner) -> Optional[tuple[dict[str, Any], dict[str, Any]]]:
    """The ConfigMap's volume and its read-only directory mount, or None when LoRA is off."""
    if not spec.lora_enabled:
        return None
    volume = {"name": LORA_VOLUME, "configMap": {"name": lora_config_map_name(owner)}}
    return volume, {"name": LORA_VOLUME, "mountPath": LORA_MOUNT, "readOnly": True}
