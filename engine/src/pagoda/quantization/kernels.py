"""The kernel of each quantized layer, by device: native CPU kernels, Triton (or ``torch._scaled_mm``) on GPUs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from pagoda.quantization.config import QuantConfig
from pagoda.quantization.weights import Fp8Weight, IntWeight, quantize_fp8_per_row

if TYPE_CHECKING:
    from pagoda.layers.linear import Linear, LinearKernel


def kernel_for_weight(
    weight: IntWeight | Fp8Weight, bias: Optional[torch.Tensor], device: torch.device, gated: bool
) -> LinearKernel:
    """The device's kernel for a canonical quantized weight; ``gated``: a [gate | up] layer whose kernel may fuse
    ``silu(gate) * up`` (CPU kernels, bf16 activations)."""
    if device.type == "cuda":
        from pagoda.layers.quant_gpu import Fp8GpuLinear, TritonIntLinear

        if isinstance(weight, IntWeight):
            return TritonIntLinear.from_int_weight(weight, bias)
        return Fp8GpuLinear.from_fp8_weight(weight, bias)
    if isinstance(weight, IntWeight):
        from pagoda.layers.int4_cpu import Int4CpuLinear

        return Int4CpuLinear.from_int_weight(weight, bias, gated)
    from pagoda.layers.fp8_cpu import Fp8CpuLinear

    return Fp8CpuLinear.from_fp8_weight(weight, bias, gated)


def online_quant_config(quantization: Optional[str]) -> Optional[QuantConfig]:
    """The methods applied at load (int8, fp8) for a model built without ``load_model``'s resolution."""
    return QuantConfig(quantization, serialized=False, bits=8) if quantization in ("int8", "fp8") else None


def quantized_layer_kernel(
    layer: Linear, module_name: str, quant: Optional[QuantConfig], device: torch.device, gated: bool
) -> Optional[LinearKernel]:
    """The kernel of ``layer`` when it is quantized: it holds a checkpoint's quantized tensors, or FP8 is applied
    at load (every linear but the lm_head, as the checkpoint formats leave it); None for a dense layer."""
    source = getattr(layer, "quant_source", None)
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
    if online_fp8 and module_name.rsplit(".", 1)[-1] != "lm_head":
        return kernel_for_weight(quantize_fp8_per_row(layer.weight), bias, device, gated)
    return None
