"""Quantized linear layers on GPUs (:class:`~pagoda.layers.linear.LinearKernel` objects), built from the canonical
weights of :mod:`pagoda.quantization.weights`:

- :class:`TritonIntLinear` (AWQ / GPTQ, ``int4-triton`` / ``int8-triton``): the weight repacked once into
  :mod:`pagoda_kernels.int_gemm`'s layout (values packed in int32 words along K, 16-bit scales where exact);
  the Triton GEMM dequantizes tile by tile, act order (``perm``) included.
- :class:`Fp8GpuLinear` (FP8 checkpoints and online ``--quantization fp8``): ``fp8-scaled-mm`` on GPUs with FP8
  tensor cores (compute capability >= 8.9) when K and N are multiples of 16: activations quantized per token
  (or with the checkpoint's static ``input_scale``) and ``torch._scaled_mm`` with row-wise scales (unit
  per-tensor scales plus a scaling pass where the torch build rejects row-wise); elsewhere
  ``fp8-triton-w8a16``: the weight bytes widened to the activation dtype inside a Triton GEMM.

Calls never sync with the device and allocate only by shape, so they can be captured in CUDA graphs. On CPU
tensors the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` before the kernels are imported;
tests only). Kernel modules are imported when a layer is built, so importing this module needs no Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from pagoda.quantization.weights import Fp8Weight, IntWeight

if TYPE_CHECKING:
    from pagoda_kernels.int_gemm import PackedIntWeight


def fp8_scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores that ``torch._scaled_mm`` drives: a CUDA (not ROCm) GPU of
    compute capability 8.9 (Ada) or newer."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "_scaled_mm")


def _on_device(bias: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if bias is None else bias.detach().to(device).contiguous()


@dataclass(slots=True)
class TritonIntLinear:
    """A group-wise int4/int8 weight (AWQ, GPTQ) served by the Triton weight-only GEMM."""

    packed: PackedIntWeight
    bias: Optional[torch.Tensor]  # [out]
    name: str
    gemm: Callable[..., torch.Tensor] = field(repr=False)  # pagoda_kernels.int_gemm.int_gemm, imported once

    @staticmethod
    def from_int_weight(weight: IntWeight, bias: Optional[torch.Tensor]) -> TritonIntLinear:
        """Repack ``weight`` (on the device it will run on) into the kernel's layout."""
        from pagoda_kernels.int_gemm import int_gemm, pack_int_weight

        w = weight
        packed = pack_int_weight(w.qweight, w.scales, w.zeros, w.group_size, w.bits, w.perm)
        return TritonIntLinear(packed, _on_device(bias, w.qweight.device), f"int{w.bits}-triton", int_gemm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        return self.gemm(x, self.packed, self.bias)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:  # self(x).float(), written by the GEMM's epilogue
        return self.gemm(x, self.packed, self.bias, float_output=True)


@dataclass(slots=True)
class Fp8GpuLinear:
    """An FP8 e4m3 weight with per-row scales: FP8 tensor-core GEMM where the GPU has one, else w8a16 Triton."""

    qweight: torch.Tensor  # [out, in] float8_e4m3fn, contiguous
    scales: torch.Tensor  # [out] float32
    input_scale: Optional[torch.Tensor]  # [1] float32 static activation scale; None: per token
    bias: Optional[torch.Tensor]  # [out]
    rowwise_dtypes: frozenset[torch.dtype]  # out_dtypes the probe saw _scaled_mm take row-wise scales into
    name: str
    gemm: Callable[..., torch.Tensor] = field(repr=False)  # fp8_scaled_mm or fp8_w8a16_gemm, imported once

    @staticmethod
    def from_fp8_weight(weight: Fp8Weight, bias: Optional[torch.Tensor]) -> Fp8GpuLinear:
        """Choose the path for ``weight``'s device and shape; the weight is kept as it is."""
        from pagoda_kernels.fp8_gemm import (
            fp8_scaled_mm,
            fp8_w8a16_gemm,
            rowwise_scaled_mm_supported,
            tensorwise_scaled_mm_supported,
        )

        device = weight.qweight.device
        qweight = weight.qweight.contiguous()
        scales = weight.scales.to(device=device, dtype=torch.float32).contiguous()
        input_scale = None
        if weight.input_scale is not None:
            input_scale = weight.input_scale.detach().to(device=device, dtype=torch.float32).reshape(1)
        out_features, in_features = qweight.shape
        bias = _on_device(bias, device)
        shapes_fit = in_features % 16 == 0 and out_features % 16 == 0
        # Every _scaled_mm configuration a call may use is probed first: unit per-tensor scales into float32 (the
        # fallback), and row-wise into each output dtype; a device that takes neither gets the Triton GEMM.
        if fp8_scaled_mm_supported(device) and shapes_fit and tensorwise_scaled_mm_supported(device):
            dtypes = (torch.bfloat16, torch.float16, torch.float32)
            rowwise = frozenset(dt for dt in dtypes if rowwise_scaled_mm_supported(device, dt))
            return Fp8GpuLinear(qweight, scales, input_scale, bias, rowwise, "fp8-scaled-mm", fp8_scaled_mm)
        return Fp8GpuLinear(qweight, scales, input_scale, bias, frozenset(), "fp8-triton-w8a16", fp8_w8a16_gemm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        if self.name == "fp8-scaled-mm":
            return self.gemm(x, self.qweight, self.scales, self.input_scale, self.bias, self.rowwise(x.dtype))
        return self.gemm(x, self.qweight, self.scales, self.bias)

    def rowwise(self, x_dtype: torch.dtype) -> bool:
        """Whether ``fp8-scaled-mm`` takes the row-wise path for ``x_dtype``: only when the load-time probe approved
        the very output dtype that call asks for (float32 when there is a bias, not x's dtype)."""
        from pagoda_kernels.fp8_gemm import rowwise_out_dtype

        return rowwise_out_dtype(x_dtype, self.bias is not None) in self.rowwise_dtypes

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == "fp8-scaled-mm":
            return self(x).float()
        return self.gemm(x, self.qweight, self.scales, self.bias, float_output=True)
