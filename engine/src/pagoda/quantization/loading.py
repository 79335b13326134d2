"""Reading a quantized checkpoint: which quantization it has, and collecting each quantized layer's tensors.

A layer the checkpoint quantizes (AWQ/GPTQ ``qweight``..., FP8 ``weight`` + ``weight_scale``) never gets a dense
weight: the loader (:func:`pagoda.loader.attach_quantized_sources`) gives it a :class:`QuantizedSource`, which
collects the layer's checkpoint tensors (for a fused [q | k | v] or [gate | up] projection, each part's) as
:class:`QuantizedLoad` routes them past, uncast. :func:`pagoda.layers.linear_kernels.prepare_linear_layers` later
turns each source into the canonical weight (:mod:`pagoda.quantization.weights`) and that into the device's kernel,
one layer at a time, so the packed checkpoint tensors are the only full copy of the weights ever held.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import safe_open
from torch import nn

from pagoda.quantization.config import QuantConfig, resolve_quant_config
from pagoda.quantization.formats import (
    OPTIONAL_SUFFIXES,
    QUANT_TENSOR_SUFFIXES,
    build_quantized_weight,
)
from pagoda.quantization.weights import Fp8Weight, IntWeight


def read_hf_config(model_dir: Union[str, Path]) -> dict:
    """config.json of a Hugging Face model directory, as a dict; older AutoGPTQ/AutoAWQ exports that describe their
    quantization only in ``quantize_config.json`` / ``quant_config.json`` get it as ``quantization_config``."""
    path = Path(model_dir)
    config = json.loads((path / "config.json").read_text())
    if "quantization_config" in config or "compression_config" in config:
        return config
    gptq, awq = path / "quantize_config.json", path / "quant_config.json"
    if gptq.is_file():
        config["quantization_config"] = {"quant_method": "gptq", **json.loads(gptq.read_text())}
    elif awq.is_file():
        legacy = json.loads(awq.read_text())  # AutoAWQ: w_bit, q_group_size, zero_point, version "GEMM"
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": legacy.get("w_bit", legacy.get("bits")),
            "group_size": legacy.get("q_group_size", legacy.get("group_size")),
            "zero_point": legacy.get("zero_point", True),
            "version": str(legacy.get("version", "gemm")).lower(),
        }
    return config


def quant_config_for(model_dir: Union[str, Path], requested: Optional[str]) -> Optional[QuantConfig]:
    """What the engine runs for ``--quantization requested`` on this checkpoint (ValueError on a mismatch)."""
    return resolve_quant_config(requested, read_hf_config(model_dir))


@dataclass
class QuantizedSource:
    """The checkpoint tensors of one quantized layer: ``parts[i][suffix]`` for part i (one part unless fused)."""

    config: QuantConfig
    hf_modules: tuple[str, ...]  # the checkpoint's module name of each part
    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.parts = [{} for _ in self.hf_modules]

    def build(self) -> IntWeight | Fp8Weight:
        """The canonical weight of the whole (fused) layer; the collected tensors are released."""
        missing = [
            f"{module}.{suffix}"
            for module, tensors in zip(self.hf_modules, self.parts)
            for suffix in _required_suffixes(self.config)
            if suffix not in tensors
        ]
        if missing:
            raise ValueError(f"quantized checkpoint is missing {', '.join(missing[:4])}")
        weights = [build_quantized_weight(self.config, tensors) for tensors in self.parts]
        self.parts = []
        if len(weights) == 1:
            return weights[0]
        return type(weights[0]).concat(weights)  # type: ignore[arg-type]


def _required_suffixes(config: QuantConfig) -> tuple[str, ...]:
    """What every part must have; the converter checks the rest (e.g. symmetric AWQ may omit qzeros)."""
    optional = set(OPTIONAL_SUFFIXES[config.method])
    return tuple(s for s in QUANT_TENSOR_SUFFIXES[config.method] if s not in optional)


def checkpoint_tensor_names(files: list[Path]) -> set[str]:
    """Every tensor name of the checkpoint (read from the safetensors headers only)."""
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())  # noqa: SIM118 (safe_open objects are not iterable)
    return names


class QuantizedLoad:
    """Routes a quantized checkpoint's tensors: those of quantized layers to their :class:`QuantizedSource`."""

    def __init__(self, config: QuantConfig, sources: list[QuantizedSource]) -> None:
        self.config = config
        # checkpoint module name -> (the layer's source, the part it fills)
        self._by_hf_module = {hf: (source, i) for source in sources for i, hf in enumerate(source.hf_modules)}
        self._suffixes = set(QUANT_TENSOR_SUFFIXES[config.method])

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` (uncast) if it belongs to a quantized layer; False: it is an ordinary weight."""
        module, _, suffix = name.rpartition(".")
        entry = self._by_hf_module.get(module)
        if entry is None or suffix not in self._suffixes:
            return False
        source, part = entry
        source.parts[part][suffix] = tensor
        return True


def apply_kv_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Checkpoint KV-cache scales (``<layer>.self_attn.k_scale`` / ``v_scale``; ``kv_scale`` sets both) onto each
    attention layer, for an FP8 KV cache. Layers without one keep 1.0."""
    by_layer: dict[str, dict[str, float]] = {}
    for name, tensor in scales.items():
        prefix, _, kind = name.rpartition(".")
        values = by_layer.setdefault(prefix, {})
        value = float(tensor.float().reshape(-1)[0])
        for key in ("k_scale", "v_scale") if kind == "kv_scale" else (kind,):
            values[key] = value
    for prefix, values in by_layer.items():
        attn = model.get_submodule(f"{prefix}.attn")
        attn.set_kv_scales(values.get("k_scale", 1.0), values.get("v_scale", 1.0))


KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.kv_scale")
