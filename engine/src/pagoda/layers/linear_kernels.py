"""How a :class:`~pagoda.layers.linear.Linear` multiplies once its weights are loaded.

After loading, :func:`prepare_linear_layers` gives each layer a kernel object holding the weight in the layout its
device reads fastest, and the plain weight is released:

- dense bf16/fp16 on the CPU: the native tile-layout kernels or a oneDNN-prepacked weight
  (:mod:`pagoda.layers.cpu_linear`);
- ``--quantization int8``: weight-only int8 (:mod:`pagoda.layers.int8_cpu`);
- a quantized checkpoint's layers (AWQ / GPTQ / FP8) and online ``--quantization fp8``: the canonical weight
  (:mod:`pagoda.quantization.weights`) handed to the device's kernel: :mod:`pagoda.layers.int4_cpu` and
  :mod:`pagoda.layers.fp8_cpu` on the CPU, :mod:`pagoda.layers.quant_gpu` on GPUs.

For bf16 (and int8 with bf16 activations) the choice per layer shape is measured on this machine
(:mod:`pagoda.layers.kernel_timing`, :mod:`pagoda.cpu.kernel_selection`). fp32 on the CPU keeps ``F.linear`` (MKL's
sgemm, which oneDNN's packed path does not reproduce bit for bit), and so does every dense dtype on CUDA, where
cuBLAS needs no help.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from pagoda.capabilities import QUANTIZATION_DEVICES
from pagoda.config import QUANTIZATIONS
from pagoda.layers.cpu_linear import (
    NATIVE_BF16,
    NativeBf16Linear,
    NativeGatedBf16Linear,
    PackedLinear,
    gated_tiles_fit,
    native_linear_support,
    onednn_packing_available,
)
from pagoda.layers.fp8_cpu import Fp8CpuLinear
from pagoda.layers.int4_cpu import Int4CpuLinear
from pagoda.layers.int8_cpu import Int8WeightOnlyLinear
from pagoda.layers.kernel_timing import ModelKernelSelector, candidate_kernels
from pagoda.layers.linear import Linear, LinearKernel, MergedLinear
from pagoda.layers.quant_gpu import Fp8GpuLinear, TritonIntLinear
from pagoda.quantization.config import QuantConfig
from pagoda.quantization.weights import Fp8Weight, IntWeight, quantize_fp8_per_row

logger = logging.getLogger(__name__)


def validate_quantization(quantization: Optional[str], device: torch.device) -> None:
    """Raise ValueError for a quantization this engine cannot run on ``device``."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported (supported: {', '.join(QUANTIZATIONS)})")
    devices = QUANTIZATION_DEVICES[quantization]
    if device.type not in devices:
        raise ValueError(
            f"quantization {quantization!r} runs on {' and '.join(devices)} only, not {device.type}; "
            f"drop it or use --device {devices[0]}"
        )


def prepare_linear_layers(
    model: nn.Module, device: torch.device, dtype: torch.dtype, quantization: Optional[str]
) -> dict[str, int]:
    """Give every Linear of ``model`` its kernel; return how many layers got which kernel.

    bf16 on the CPU (and int8 with bf16 activations) chooses between the native and oneDNN kernels per layer shape by
    timing them here (:mod:`pagoda.cpu.kernel_selection`; ``$PAGODA_CPU_KERNELS`` forces one kind).
    """
    validate_quantization(quantization, device)
    # load_model sets quant_config: the method resolved for the checkpoint (a model built otherwise: the argument)
    quant = getattr(model, "quant_config", None) or online_quant_config(quantization)
    method = quant.method if quant is not None else None
    dense_quantization = "int8" if method == "int8" else None  # the other methods leave some layers dense (lm_head)
    cpu = device.type == "cpu"
    pack = cpu and onednn_packing_available(dtype)
    native_bf16 = cpu and dtype == torch.bfloat16 and native_linear_support(NATIVE_BF16)
    selector = ModelKernelSelector(dtype, dense_quantization) if cpu and dtype == torch.bfloat16 else None
    counts: dict[str, int] = {}
    for module_name, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        gated = isinstance(layer, MergedLinear) and layer.gated
        quantized = quantized_layer_kernel(layer, module_name, quant, device, gated and dtype == torch.bfloat16)
        layer_quantization = None if layer.keep_dense else dense_quantization
        if quantized is not None:
            kernel = quantized
        elif selector is not None:
            role = "gated" if gated else "logits" if module_name.rsplit(".", 1)[-1] == "lm_head" else "linear"
            kernel = selector.kernel(layer, role, candidate_kernels(layer.out_features, gated, layer_quantization))
        else:
            kernel = _kernel_for(layer, pack, native_bf16, layer_quantization, gated)
        if kernel is not None:
            layer.set_kernel(kernel)
        name = kernel.name if kernel is not None else "torch-linear"
        counts[name] = counts.get(name, 0) + 1
    if selector is not None:
        selector.finish()
    logger.info("linear kernels: %s", ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())))
    return counts


def _kernel_for(
    layer: Linear, pack: bool, native_bf16: bool, quantization: Optional[str], gated: bool
) -> Optional[NativeBf16Linear | NativeGatedBf16Linear | PackedLinear | Int8WeightOnlyLinear]:
    """fp32 and fp16 models and CUDA: the fixed choice (no timing)."""
    bias = None if layer.bias is None else layer.bias.detach()
    if quantization == "int8":  # the fused epilogue takes bf16 activations: other dtypes keep checkpoint order
        return Int8WeightOnlyLinear.from_weight(layer.weight, bias, gated and layer.weight.dtype == torch.bfloat16)
    if native_bf16 and gated and gated_tiles_fit(layer.out_features):
        return NativeGatedBf16Linear.from_weight(layer.weight, bias)
    if native_bf16:
        return NativeBf16Linear.from_weight(layer.weight, bias)
    if pack:
        return PackedLinear.from_weight(layer.weight, bias)
    return None


def kernel_for_weight(
    weight: IntWeight | Fp8Weight, bias: Optional[torch.Tensor], device: torch.device, gated: bool
) -> LinearKernel:
    """The device's kernel for a canonical quantized weight; ``gated``: a [gate | up] layer whose kernel may fuse
    ``silu(gate) * up`` (CPU kernels, bf16 activations)."""
    if device.type == "cuda":
        if isinstance(weight, IntWeight):
            return TritonIntLinear.from_int_weight(weight, bias)
        return Fp8GpuLinear.from_fp8_weight(weight, bias)
    if isinstance(weight, IntWeight):
        return Int4CpuLinear.from_int_weight(weight, bias, gated)
    return Fp8CpuLinear.from_fp8_weight(weight, bias, gated)


def online_quant_config(quantization: Optional[str]) -> Optional[QuantConfig]:
    """The methods applied at load (int8, fp8) for a model built without ``load_model``'s resolution."""
    return QuantConfig(quantization, serialized=False, bits=8) if quantization in ("int8", "fp8") else None


def quantized_layer_kernel(
    layer: Linear, module_name: str, quant: Optional[QuantConfig], device: torch.device, gated: bool
) -> Optional[LinearKernel]:
    """The kernel of ``layer`` when it is quantized: it holds a checkpoint's quantized tensors, or FP8 is applied
    at load (every linear but the lm_head, as the checkpoint formats leave it); None for a dense layer."""
    source = layer.quant_source
    bias = None if layer.bias is None else layer.bias.detach()
    if source is not None:
        weight = source.build()
        layer.quant_source = None  # the checkpoint tensors go once the kernel holds its copy
        if (weight.out_features, weight.in_features) != (layer.out_features, layer.in_features):
            raise ValueError(
                f"{module_name}: the checkpoint's quantized weight is [{weight.out_features}, {weight.in_features}], "
                f"the model's config says [{layer.out_features}, {layer.in_features}]"
            )
        return kernel_for_weight(weight, bias, device, gated)
    online_fp8 = quant is not None and quant.method == "fp8" and not quant.serialized
    if online_fp8 and module_name.rsplit(".", 1)[-1] != "lm_head" and not layer.keep_dense:
        return kernel_for_weight(quantize_fp8_per_row(layer.weight), bias, device, gated)
    return None
