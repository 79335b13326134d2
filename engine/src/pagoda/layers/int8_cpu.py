"""Weight-only int8 linear layers on the CPU (``--quantization int8``): symmetric per-output-channel int8 weights,
bf16/fp32 activations, ``y = (x @ q^T) * scale``.

- :class:`Int8WeightOnlyLinear`: half the bytes of bf16 per token, read by the native AVX-512 kernel
  (``packed_linear_int8.cpp``) at every batch size; gated [gate | up] layers get the same SiLU epilogue as the bf16
  kernel.
- :class:`Int8OnednnLinear`: the int8 values as bf16 in oneDNN's layout (AMX tiles where present), a candidate the
  kernel selection may keep for prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagoda.layers.cpu_linear import (
    NATIVE_BF16,
    NATIVE_INT8,
    PackedLinear,
    TwoOutputKernel,
    gated_tile_order,
    gated_tiles_fit,
    native_linear_support,
    untile_gated,
)

_INT8_MAX = 127


@dataclass(slots=True)
class Int8WeightOnlyLinear(TwoOutputKernel):
    """Weight-only int8: ``q = round(w / scale)`` per output row, ``scale = max|w_row| / 127``.

    Activations are never quantized to 8 bits: the native kernel holds each activation row as 16-bit
    fixed point with its own scale (finer than bf16's mantissa near the row's maximum), so a
    request's result does not depend on the rest of its batch.

    A gated [gate | up] layer (bf16 models) stores its rows, scales and bias in :func:`gated_tile_order`, and
    :meth:`silu_and_mul` runs ``silu(gate) * up`` in the kernel's epilogue, as :class:`NativeGatedBf16Linear` does.
    """

    qweight: torch.Tensor  # native: tile layout [ceil(out/64), ceil(in/2), 64, 2]; else [out, in]; int8
    scales: torch.Tensor  # [out] float32 (tile order when gated)
    bias: Optional[torch.Tensor]  # [out] (tile order when gated)
    native: bool  # qweight is in the native kernel's layout and that kernel serves small batches
    in_features: int
    gated: bool = False
    name: str = "int8-weight-only"

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: Optional[torch.Tensor], gated: bool = False) -> Int8WeightOnlyLinear:
        """Quantize ``weight`` [out, in]; ``gated``: a [gate | up] weight that may get the fused epilogue."""
        qweight, scales = quantize_int8_per_channel(weight)  # per row, so permuting rows later commutes with it
        native = native_linear_support(NATIVE_INT8)
        gated = gated and native and native_linear_support(NATIVE_BF16) and gated_tiles_fit(weight.shape[0])
        if gated:
            order = gated_tile_order(weight.shape[0])
            qweight, scales = qweight[order], scales[order].contiguous()
            bias = None if bias is None else bias[order].contiguous()
        if native:
            qweight = torch.ops.pagoda_cpu.pack_linear_weight(qweight)
        name = "int8-weight-only-gated" if gated else "int8-weight-only"
        return Int8WeightOnlyLinear(qweight, scales, bias, native, weight.shape[1], gated, name)

    def silu_and_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``silu(gate) * up`` [..., intermediate] from the epilogue (bf16 x); None where the layer is not gated."""
        if not self.gated or x.dtype != torch.bfloat16:
            return None
        n = self.scales.shape[0] // 2
        return torch.ops.pagoda_cpu.int8_silu_mul_linear(x, self.qweight, self.scales, n, self.bias)

    def _forward(self, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        out_features = self.scales.shape[0]
        if self.native:
            # Every batch size: float32/fp16 activations take the 16-bit fixed-point path at 2.7-27x the speed of
            # a dequantized MKL GEMM (1-512 rows, 2-core Zen 4; 2x a cached float32 weight's at 2048 rows). bf16
            # activations from 192 rows on widen each weight chunk to bf16 in cache (exact for |q| <= 127).
            y = torch.ops.pagoda_cpu.int8_linear(x, self.qweight, self.scales, out_features, self.bias, float_out)
            return untile_gated(y, out_features) if self.gated else y
        # no AVX512-VNNI: dequantized GEMM, x @ q^T in the activation dtype, then the per-column scale
        y = torch.nn.functional.linear(x, self.dense_qweight().to(x.dtype)) * self.scales.to(x.dtype)
        y = y if self.bias is None else y + self.bias
        return y.float() if float_out else y

    def dense_qweight(self) -> torch.Tensor:
        """The int8 weight as [out, in] in the order of ``scales`` (a copy when it is stored in the native layout)."""
        if not self.native:
            return self.qweight
        return torch.ops.pagoda_cpu.unpack_linear_weight(self.qweight, self.scales.shape[0], self.in_features)


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of weight [out, in] -> (q [out, in] int8, scales [out] float32)."""
    w32 = weight.detach().float()
    amax = w32.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)  # [out]; an all-zero row stays 0
    scales = amax / _INT8_MAX
    q = torch.round(w32 / scales.unsqueeze(1)).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.contiguous(), scales.contiguous()


@dataclass(slots=True)
class Int8OnednnLinear:
    """Weight-only int8 for bf16 activations through oneDNN: ``y = (x @ q^T) * scale``, with q held as bf16 (exact,
    |q| <= 127) in oneDNN's packed layout, so the GEMM runs on AMX tiles where the CPU has them. Twice the bytes of
    the int8 weight; the selection keeps it only for the row counts where it is faster (prefill on AMX hosts).
    The GEMM output is rounded to bf16 before the scale (one more rounding than the native kernel).
    """

    packed: PackedLinear  # q as bf16, no bias
    scales: torch.Tensor  # [out] float32
    bias: Optional[torch.Tensor]  # [out]
    name: str = "int8-onednn"

    @staticmethod
    def from_weight(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Int8OnednnLinear:
        qweight, scales = quantize_int8_per_channel(weight)
        bias = None if bias is None else bias.detach().float()
        return Int8OnednnLinear(PackedLinear.from_weight(qweight.to(torch.bfloat16), None), scales, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] bf16 -> [..., out]
        y = self.packed(x).float() * self.scales
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).float()
