"""How a :class:`~pagoda.layers.linear.Linear` multiplies once its weights are loaded.

A plain ``F.linear`` in bf16 on the CPU hands oneDNN a weight in PyTorch's row-major layout, and
oneDNN re-blocks it on every call; decode at small batch is memory bound, so that costs about a
third of the achievable bandwidth. After loading, :func:`prepare_linear_layers` replaces each
layer's weight with a kernel object:

- :class:`PackedLinear`: the weight reordered once into oneDNN's blocked layout (bf16/fp16 on the
  CPU). Results are bit-identical to ``F.linear`` (the same oneDNN GEMM, minus the reorder).
- :class:`Int8WeightOnlyLinear` (``--quantization int8``): symmetric per-output-channel int8
  weights, bf16/fp32 activations, ``y = (x @ q^T) * scale``: half the bytes of bf16 per token,
  read by a native AVX-512 kernel (:mod:`pagoda.cpu`) at decode batch sizes.

fp32 on the CPU keeps ``F.linear`` (MKL's sgemm, which oneDNN's packed path does not reproduce
bit for bit), and so does every dtype on CUDA, where cuBLAS needs no help.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pagoda.config import QUANTIZATIONS

if TYPE_CHECKING:
    from pagoda.layers.linear import Linear

logger = logging.getLogger(__name__)

_INT8_MAX = 127


@dataclass(slots=True)
class PackedLinear:
    """A bf16/fp16 weight pre-reordered into oneDNN's blocked layout."""

    weight: torch.Tensor  # opaque mkldnn tensor, logically [out, in]
    bias: Optional[torch.Tensor]  # [out]
    name: str = "onednn-packed"

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> PackedLinear:
        # The batch-size hint only tunes the blocking; any number of rows works afterwards.
        return PackedLinear(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


# Up to this many rows (measured crossover on a 2-core Zen 4: ~48), the native kernel is faster; above it (prefill),
# the GEMM is compute bound and dequantizing to the activation dtype feeds oneDNN/MKL instead.
INT8_NATIVE_MAX_ROWS = 48


@dataclass(slots=True)
class Int8WeightOnlyLinear:
    """Weight-only int8: ``q = round(w / scale)`` per output row, ``scale = max|w_row| / 127``.

    Activations are never quantized to 8 bits: the native kernel holds each activation row as 16-bit
    fixed point with its own scale (finer than bf16's mantissa near the row's maximum), so a
    request's result does not depend on the rest of its batch.
    """

    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32
    bias: Optional[torch.Tensor]  # [out]
    native: bool  # the compiled small-batch kernel is available
    name: str = "int8-weight-only"

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Int8WeightOnlyLinear:
        from pagoda.cpu import cpu_ops

        qweight, scales = quantize_int8_per_channel(weight)
        return Int8WeightOnlyLinear(qweight, scales, bias, native=cpu_ops())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        rows = x.numel() // x.shape[-1]
        if self.native and rows <= INT8_NATIVE_MAX_ROWS:
            return torch.ops.pagoda_cpu.int8_linear(x, self.qweight, self.scales, self.bias)
        # dequantized GEMM: x @ q^T in the activation dtype, then the per-column scale
        y = torch.nn.functional.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of weight [out, in] -> (q [out, in] int8, scales [out] float32)."""
    w32 = weight.detach().float()
    amax = w32.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)  # [out]; an all-zero row stays 0
    scales = amax / _INT8_MAX
    q = torch.round(w32 / scales.unsqueeze(1)).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def validate_quantization(quantization: Optional[str], device: torch.device) -> None:
    """Raise ValueError for a quantization this engine cannot run on ``device``."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported (supported: {', '.join(QUANTIZATIONS)})")
    if device.type != "cpu":
        raise ValueError("quantization 'int8' (weight-only) runs on the CPU only; drop it or use --device cpu")


def onednn_packing_available(dtype: torch.dtype) -> bool:
    """Whether this CPU build and machine can run oneDNN's packed linear in ``dtype``."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def prepare_linear_layers(
    model: nn.Module, device: torch.device, dtype: torch.dtype, quantization: Optional[str]
) -> dict[str, int]:
    """Give every Linear of ``model`` its kernel; return how many layers got which kernel."""
    from pagoda.layers.linear import Linear

    validate_quantization(quantization, device)
    pack = device.type == "cpu" and onednn_packing_available(dtype)
    counts: dict[str, int] = {}
    for layer in model.modules():
        if not isinstance(layer, Linear):
            continue
        kernel = _kernel_for(layer, pack, quantization)
        if kernel is not None:
            layer.set_kernel(kernel)
        name = kernel.name if kernel is not None else "torch-linear"
        counts[name] = counts.get(name, 0) + 1
    logger.info("linear kernels: %s", ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())))
    return counts


def _kernel_for(
    layer: Linear, pack: bool, quantization: Optional[str]
) -> Optional[PackedLinear | Int8WeightOnlyLinear]:
    bias = None if layer.bias is None else layer.bias.detach()
    if quantization == "int8":
        return Int8WeightOnlyLinear.from_weight(layer.weight, bias)
    if pack:
        return PackedLinear.from_weight(layer.weight, bias)
    return None
