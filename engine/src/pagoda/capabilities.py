"""What this engine build can serve: the one capability contract between the engine and the operator.

``pagoda capabilities --json`` prints :func:`capabilities`. The operator ships a copy
(``pagoda_operator/engine_capabilities.json``) that a test holds equal to this output, and refuses every
ModelDeployment outside it with ``InvalidSpec`` naming the field, before a pod starts. The engine's own checks read
the same constants, so the contract cannot drift from what the code does. When a feature lands, it changes here
first.
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path
from typing import Any

from pagoda.version import __version__

CONTRACT_VERSION = 1
MODEL_SOURCES = ("builtin", "local", "hf", "s3")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Quantization methods and the devices that run them: AWQ and GPTQ checkpoints (int4/int8 groups), FP8 (checkpoints
# or applied at load), and weight-only int8 applied at load (CPU kernels only).
QUANTIZATION_DEVICES: dict[str, tuple[str, ...]] = {
    "awq": ("cpu", "cuda"),
    "gptq": ("cpu", "cuda"),
    "fp8": ("cpu", "cuda"),
    "int8": ("cpu",),
}
# Methods whose tensors come quantized in the checkpoint: not sharded across tensor-parallel ranks yet (fp8 applied
# at load and int8 are quantized per rank, after sharding; an FP8 checkpoint with N > 1 fails at start-up).
CHECKPOINT_QUANTIZATIONS_WITHOUT_TENSOR_PARALLEL = ("awq", "gptq")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
# Tensor parallelism within one node: one worker process per device (GPUs over NCCL, CPU processes over gloo).
TENSOR_PARALLEL_MAX = 8
# Adapters are not sharded across tensor-parallel ranks yet: --enable-lora needs --tensor-parallel-size 1.
LORA_WITH_TENSOR_PARALLEL = False
# The model sizes a tensor-parallel size must divide (vocab is padded, so it need not); num_key_value_heads must
# divide it or be divisible by it (fewer KV heads than ranks are replicated).
TENSOR_PARALLEL_DIVIDES = ("num_attention_heads", "intermediate_size")
LORA_SUPPORTED = True
LORA_RANKS = (8, 16, 32, 64, 128, 256)  # the slot widths --max-lora-rank takes (vLLM's choices)
DEFAULT_MAX_LORAS = 4  # --max-loras
DEFAULT_MAX_LORA_RANK = 16  # --max-lora-rank
DEVICES = ("cpu", "cuda")
# --task: generate text, or pool it (pagoda.pooling: embeddings, relevance scores; no KV cache, no LoRA)
TASKS = ("generate", "embed", "score")


def capabilities(serve_parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The contract as JSON-ready data; ``serve_parser`` is ``pagoda serve``'s, whose flags it lists."""
    return {
        "contract_version": CONTRACT_VERSION,
        "engine_version": __version__,
        "model_sources": list(MODEL_SOURCES),
        "dtypes": list(DTYPES),
        "devices": {
            device: {
                "quantization": sorted(q for q, devices in QUANTIZATION_DEVICES.items() if device in devices),
                "kv_cache_dtypes": list(KV_CACHE_DTYPES),
                "tensor_parallel_max": TENSOR_PARALLEL_MAX,
                "quantization_without_tensor_parallel": sorted(
                    q for q in CHECKPOINT_QUANTIZATIONS_WITHOUT_TENSOR_PARALLEL if device in QUANTIZATION_DEVICES[q]
                ),
            }
            for device in DEVICES
        },
        "lora": {
            "supported": LORA_SUPPORTED,
            "max_rank": max(LORA_RANKS),
            "ranks": list(LORA_RANKS),
            "default_max_loras": DEFAULT_MAX_LORAS,
            "default_max_lora_rank": DEFAULT_MAX_LORA_RANK,
            "runtime_updates": True,
            "tensor_parallel": LORA_WITH_TENSOR_PARALLEL,
        },
        "tensor_parallel": {
            "divides": list(TENSOR_PARALLEL_DIVIDES),
            "kv_heads": "divides or is divisible by the tensor-parallel size (replicated when fewer than ranks)",
            "builtin_model": builtin_model_geometry(),
        },
        "chat_template": True,
        "tasks": list(TASKS),
        "serve_flags": serve_flags(serve_parser),
    }


def builtin_model_path() -> Path:
    """The bundled stories260K checkpoint (MIT, see its README): the ``builtin`` model source."""
    return Path(str(resources.files("pagoda") / "assets" / "models" / "stories260K"))


def builtin_model_geometry() -> dict[str, int]:
    """The built-in model's sizes that tensor parallelism divides, so the operator can check them without it."""
    from pagoda.model_config import ModelConfig

    config = ModelConfig.from_model_dir(builtin_model_path())
    return {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }


def serve_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every long option the parser takes (``--x`` and ``--no-x`` of boolean flags)."""
    return sorted(option for action in parser._actions for option in action.option_strings if option.startswith("--"))
