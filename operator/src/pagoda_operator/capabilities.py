"""The engine's capability contract, as the operator applies it: every spec outside it is refused with
``InvalidSpec`` naming the field, before a pod starts.

``engine_capabilities.json`` is a copy of ``pagoda capabilities --json`` from the engine image this operator
release deploys by default; a test holds it equal to the engine's output, so a feature the engine gains (or loses)
cannot go unnoticed here. A ModelDeployment that names another image with ``spec.engine.image`` is still checked
against this copy.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from pagoda_operator.spec import InvalidSpec, ModelDeploymentSpec

# engine flags the operator derives from spec fields: in extraArgs they would silently override the field
SPEC_FLAGS = {
    "--host": "the pod's address (set by the operator)",
    "--port": "the pod's port (set by the operator)",
    "--served-model-name": "spec.model.servedModelName",
    "--revision": "spec.model.revision",
    "--download-dir": "spec.modelCache",
    "--max-model-len": "spec.maxModelLen",
    "--max-num-seqs": "spec.maxNumSeqs",
    "--gpu-memory-utilization": "spec.gpuMemoryUtilization",
    "--dtype": "spec.dtype",
    "--device": "spec.gpus",
    "--enable-prefix-caching": "spec.enablePrefixCaching",
    "--no-enable-prefix-caching": "spec.enablePrefixCaching",
    "--tensor-parallel-size": "spec.gpus",
    "--quantization": "spec.quantization",
    "--kv-cache-dtype": "spec.kvCacheDtype",
    "--enable-lora": "spec.loraAdapters",
    "--lora-modules": "spec.loraAdapters",
    "--lora-modules-file": "spec.loraAdapters",
    # adapters loaded through the API would live on one pod only, vanish when it restarts and shadow a listed
    # adapter of the same name: spec.loraAdapters is the one way in
    "--allow-runtime-lora-updates": "spec.loraAdapters",
    "--max-loras": "spec.maxLoras",
    "--max-lora-rank": "spec.maxLoraRank",
    "--max-cpu-loras": "spec.maxCpuLoras",
    "--shutdown-timeout": "spec.drainSeconds",
    "--chat-template": "spec.engine.chatTemplate",
    "--api-key": "spec.apiKeySecretRef",
    "--model": "spec.model",
    "--no-enable-lora": "spec.loraAdapters",
    "--no-allow-runtime-lora-updates": "spec.loraAdapters",
    "--task": "spec.task",
    "--kv-events-config": "spec.routing.kvEvents",
    "--runner": "spec.task",
    "--convert": "spec.task",
    # a flags file would have to be in the pod, and it could set any of the above unseen
    "--config": "spec.engine.extraArgs (list the flags themselves)",
}
_SOURCE_KINDS = {"builtin": "builtin", "hf": "hf", "s3": "s3", "pvc": "local", "path": "local"}


@functools.cache
def engine_capabilities() -> dict[str, Any]:
    """The contract this operator release checks specs against."""
    return json.loads(resources.files("pagoda_operator").joinpath("engine_capabilities.json").read_text())


def check_capabilities(spec: ModelDeploymentSpec, contract: dict[str, Any] | None = None) -> None:
    """Raise ``InvalidSpec`` for the first field the engine cannot serve."""
    contract = contract or engine_capabilities()
    device = "cuda" if spec.gpus > 0 else "cpu"
    served = contract["devices"][device]
    if spec.gpus > served["tensor_parallel_max"]:
        raise InvalidSpec(
            "spec.gpus",
            f"{spec.gpus} GPUs per replica needs tensor parallelism {spec.gpus}; this engine serves at most "
            f"{served['tensor_parallel_max']}",
        )
    if spec.task not in contract.get("tasks", ["generate"]):  # contracts before pooling models serve generate only
        raise InvalidSpec("spec.task", f"this engine does not serve task {spec.task}")
    _check_builtin_geometry(spec, contract)
    _check_quantization(spec, device, served)
    _check_lora(spec, contract)
    if _SOURCE_KINDS[spec.model.kind] not in contract["model_sources"]:
        raise InvalidSpec("spec.model.source", f"this engine cannot load {spec.model.kind} sources")
    if spec.dtype is not None and spec.dtype not in contract["dtypes"]:
        raise InvalidSpec("spec.dtype", f"{spec.dtype} is not one of {', '.join(contract['dtypes'])}")
    if spec.chat_template is not None and not contract["chat_template"]:
        raise InvalidSpec("spec.engine.chatTemplate", "this engine does not take a chat template")
    if spec.routing.kv_events and "--kv-events-config" not in contract["serve_flags"]:
        raise InvalidSpec("spec.routing.kvEvents", "this engine does not publish KV cache events (--kv-events-config)")
    _check_extra_args(spec.extra_args, set(contract["serve_flags"]))


def _check_quantization(spec: ModelDeploymentSpec, device: str, served: dict[str, Any]) -> None:
    """The quantization method and the KV-cache dtype must be ones the engine serves on the replica's device, and a
    method whose tensors come quantized in the checkpoint must not need sharding where the engine cannot shard it."""
    if spec.quantization is not None and spec.quantization not in served["quantization"]:
        offered = ", ".join(served["quantization"]) or "none"
        raise InvalidSpec(
            "spec.quantization", f"{spec.quantization} is not served on {device} replicas by this engine ({offered})"
        )
    if spec.gpus > 1 and spec.quantization in served.get("quantization_without_tensor_parallel", ()):
        # the engine refuses these checkpoints with --tensor-parallel-size > 1 at start-up (the CRD's CEL rule says
        # the same; this covers bodies that did not pass it and an engine whose contract differs)
        raise InvalidSpec(
            "spec.quantization",
            f"this engine does not serve {spec.quantization} checkpoints with tensor parallelism (spec.gpus is "
            f"{spec.gpus}): set gpus to 1",
        )
    kv_dtypes = served.get("kv_cache_dtypes", ["auto"])
    if spec.kv_cache_dtype is not None and spec.kv_cache_dtype not in kv_dtypes:
        raise InvalidSpec(
            "spec.kvCacheDtype",
            f"{spec.kv_cache_dtype} is not served on {device} replicas by this engine ({', '.join(kv_dtypes)})",
        )


def _check_lora(spec: ModelDeploymentSpec, contract: dict[str, Any]) -> None:
    """LoRA (on whenever spec.loraAdapters is present) only where the engine serves it, at a rank it serves;
    adapters take the model's source forms."""
    if not spec.lora_enabled:
        return
    lora = contract["lora"]
    if not lora["supported"]:
        raise InvalidSpec("spec.loraAdapters", "this engine does not serve LoRA adapters")
    if spec.gpus > 1 and not lora.get("tensor_parallel", False):
        # the engine refuses --enable-lora with --tensor-parallel-size > 1 at start-up: refuse it here, before a
        # pod holds N GPUs only to crash-loop
        raise InvalidSpec(
            "spec.loraAdapters",
            f"this engine does not serve LoRA adapters with tensor parallelism (spec.gpus is {spec.gpus}): "
            "set gpus to 1, or remove loraAdapters",
        )
    ranks = lora.get("ranks", [])
    if spec.max_lora_rank is not None and ranks and spec.max_lora_rank not in ranks:
        raise InvalidSpec(
            "spec.maxLoraRank", f"{spec.max_lora_rank} is not a rank this engine serves ({', '.join(map(str, ranks))})"
        )
    for index, adapter in enumerate(spec.lora_adapters):
        if _SOURCE_KINDS[adapter.source.kind] not in contract["model_sources"]:
            raise InvalidSpec(
                f"spec.loraAdapters[{index}].source", f"this engine cannot load {adapter.source.kind} sources"
            )


def _check_builtin_geometry(spec: ModelDeploymentSpec, contract: dict[str, Any]) -> None:
    """The built-in model must split evenly over ``spec.gpus`` ranks, by the engine's own rule (``tensor_parallel``
    in the contract). Only the built-in model's sizes are known here: any other model is checked by the engine when
    it loads the model's config, and a size that does not divide fails its start-up (``UnsupportedSpec``)."""
    rule = contract.get("tensor_parallel")
    if spec.gpus <= 1 or spec.model.kind != "builtin" or not rule:
        return
    problem = tensor_parallel_problem(rule["builtin_model"], rule["divides"], spec.gpus)
    if problem:
        raise InvalidSpec("spec.gpus", f"tensor parallelism {spec.gpus} cannot split the built-in model: {problem}")


def tensor_parallel_problem(sizes: dict[str, int], divides: list[str], size: int) -> str | None:
    """Why ``size`` ranks cannot shard a model of ``sizes`` (None when they can): each of ``divides`` must be a
    multiple of ``size``; ``num_key_value_heads`` must divide ``size`` or be a multiple of it (fewer KV heads than
    ranks are replicated). The vocabulary is padded by the engine, so it need not divide."""
    for name in divides:
        if sizes[name] % size:
            return f"{name} {sizes[name]} is not divisible by {size}"
    kv_heads = sizes.get("num_key_value_heads")
    if kv_heads and kv_heads % size and size % kv_heads:
        return f"num_key_value_heads {kv_heads} neither divides nor is divisible by {size}"
    return None


def _check_extra_args(args: tuple[str, ...], flags: set[str]) -> None:
    """Each flag of ``extraArgs`` must be one ``pagoda serve`` takes, and not one a spec field sets."""
    for index, arg in enumerate(args):
        field = f"spec.engine.extraArgs[{index}]"
        if not arg.startswith("-") or _is_number(arg):
            continue  # a value of the flag before it
        name = arg.split("=", 1)[0]
        if not name.startswith("--"):
            raise InvalidSpec(field, f"{arg!r}: use the long form of the flag (pagoda serve --help)")
        if name not in flags:
            raise InvalidSpec(field, f"{name} is not a flag of pagoda serve in this engine")
        if name in SPEC_FLAGS:
            raise InvalidSpec(field, f"{name} is set from {SPEC_FLAGS[name]}; set that instead")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
