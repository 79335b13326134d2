"""Weight-only FP8 (e4m3fn, per-output-row scale) linear layers on the CPU: ``y = (x @ q^T) * scale + bias``.

The CPU has no FP8 arithmetic. The native kernel (``pagoda/cpu/packed_linear_fp8.cpp``, AVX512-BF16 and
AVX512-VBMI) keeps one byte per weight in the packed tile layout of the bf16 kernel, half of bf16's bytes, and
widens each e4m3fn value to bf16 exactly inside the kernel (every e4m3fn value is a bf16 value) before the bf16
dot products against bf16 activations; the row scale and bias are applied in the epilogue. Activations are never
quantized (w8a16).

Other activation dtypes (float32, float16) and machines without those ISA extensions take a plain-torch path that
dequantizes the weight on every call in the activation dtype (no dense copy is cached: that would cost the memory
FP8 saves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from pagoda.layers.cpu_linear import TwoOutputKernel, gated_tile_order, gated_tiles_fit, untile_gated
from pagoda.quantization.weights import Fp8Weight

# One k pair of a 64-row tile is 128 bytes: two halves of 32 rows x 2 values. Within a half the kernel's byte
# interleave (vpunpck{l,h}bw, per 128-bit lane) reads register q's word w from byte 16 * (w // 8) + 8 * q + w % 8.
_HALF_VIEW = (2, 2, 4, 8)  # [half, register q, lane w // 8, byte w % 8] in natural order


def fp8_native_available() -> bool:
    """Whether the native FP8 kernel is built for this machine (needs a compiler, AVX512-BF16 and AVX512-VBMI)."""
    from pagoda.cpu import cpu_ops

    return cpu_ops() and bool(torch.ops.pagoda_cpu.fp8_linear_support())


def pack_fp8_weight(qweight: torch.Tensor) -> torch.Tensor:
    """e4m3fn [out, in] -> the native kernel's packed bytes [ceil(out/64), ceil(in/2), 64, 2] uint8 (zero padded)."""
    packed = torch.ops.pagoda_cpu.pack_linear_weight(qweight.view(torch.uint8))  # [tiles, pairs, 64, 2]
    tiles, pairs = packed.shape[:2]
    # natural (half, q, lane, byte) -> stored (half, lane, q, byte)
    return packed.view(tiles, pairs, *_HALF_VIEW).transpose(3, 4).contiguous().view(tiles, pairs, 64, 2)


def unpack_fp8_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_fp8_weight`: [out, in] e4m3fn (one copy)."""
    tiles, pairs = packed.shape[:2]
    # stored byte 64 h + 16 lane + 8 q + j of pair p holds row 32 h + 16 q + 4 lane + j // 2, k = 2 p + j % 2
    stored = packed.view(tiles, pairs, 2, 4, 2, 4, 2)  # [tile, pair, h, lane, q, j // 2, j % 2]
    dense = stored.permute(0, 2, 4, 3, 5, 1, 6).reshape(tiles * 64, pairs * 2)
    return dense[:out_features, :in_features].view(torch.float8_e4m3fn)


@dataclass(slots=True)
class Fp8CpuLinear(TwoOutputKernel):
    """An FP8 weight-only linear layer (a :class:`~pagoda.layers.linear.LinearKernel`).

    ``native``: the weight is in the native kernel's packed layout, which serves bf16 activations; other dtypes
    unpack and dequantize it per call. A gated [gate | up] layer (native only) stores rows, scales and bias in
    :func:`~pagoda.layers.cpu_linear.gated_tile_order` and :meth:`silu_and_mul` runs ``silu(gate) * up`` in the
    kernel's epilogue.
    """

    qweight: torch.Tensor  # native: packed [ceil(out/64), ceil(in/2), 64, 2] uint8; else [out, in] float8_e4m3fn
    scales: torch.Tensor  # [out] float32 (tile order when gated)
    bias: Optional[torch.Tensor]  # [out] float32 (tile order when gated)
    native: bool
    in_features: int
    gated: bool = False
    name: str = "fp8-torch"

    @staticmethod
    def from_fp8_weight(weight: Fp8Weight, bias: Optional[torch.Tensor], gated: bool = False) -> Fp8CpuLinear:
        """Build the kernel of ``weight``; ``gated``: a [gate | up] weight that may get the fused SiLU epilogue."""
        if bias is not None and bias.shape != (weight.out_features,):
            raise ValueError(f"bias must be [{weight.out_features}], got {tuple(bias.shape)}")
        native = fp8_native_available()
        gated = gated and native and gated_tiles_fit(weight.out_features)
        if gated:
            order = gated_tile_order(weight.out_features)
            weight = weight.select_rows(order)
            bias = None if bias is None else bias[order]
        qweight = pack_fp8_weight(weight.qweight) if native else weight.qweight.contiguous()
        bias = None if bias is None else bias.detach().float().contiguous()
        name = "fp8-native-gated" if gated else "fp8-native" if native else "fp8-torch"
        return Fp8CpuLinear(qweight, weight.scales.contiguous(), bias, native, weight.in_features, gated, name)

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    def silu_and_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``silu(gate) * up`` [..., out / 2] from the epilogue (bf16 x); None where the layer is not gated."""
        if not self.gated or x.dtype != torch.bfloat16:
            return None
        n = self.out_features // 2
        return torch.ops.pagoda_cpu.fp8_silu_mul_linear(x, self.qweight, self.scales, n, self.bias)

    def dense_qweight(self) -> torch.Tensor:
        """The e4m3fn weight [out, in] in the order of ``scales`` (a copy when it is stored packed)."""
        if not self.native:
            return self.qweight
        return unpack_fp8_weight(self.qweight, self.out_features, self.in_features)

    def _forward(self, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        if self.native and x.dtype == torch.bfloat16:
            y = torch.ops.pagoda_cpu.fp8_linear(x, self.qweight, self.scales, self.out_features, self.bias, float_out)
        else:
            # plain torch: Fp8Weight.dequantize in float32, rounded once to x's dtype
            weight = (self.dense_qweight().float() * self.scales.unsqueeze(1)).to(x.dtype)
            y = F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
            y = y.float() if float_out else y
        return untile_gated(y, self.out_features) if self.gated else y
