"""The engine's canonical forms of quantized weights: every checkpoint format is converted to one of these at load,
and every kernel (CPU native, Triton, torch fallback) is built from one of these.

- :class:`IntWeight`: group-wise integer weights with zero points (AWQ, GPTQ 4 and 8 bits):
  ``w[n, k] = (q[n, k] - zeros[g, n]) * scales[g, n]`` with ``g = k // group_size``, where ``k`` counts the
  *kernel's* input order; with ``perm`` set (GPTQ act order), kernel input ``k`` is checkpoint input ``perm[k]``,
  so ``y = x[..., perm] @ w.T``.
- :class:`Fp8Weight`: float8 e4m3 weights with per-output-row float32 scales (a per-tensor scale is broadcast to
  every row): ``w[n, k] = float(q[n, k]) * scales[n]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch


class _RowMajorWeight:
    """What both canonical forms share: ``qweight`` is [out, in], one row per output feature."""

    qweight: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in float32, in the kernel's input order."""
        raise NotImplementedError

    def dequantize_checkpoint_order(self) -> torch.Tensor:
        """The weight [out, in] in float32 in the checkpoint's input order: what ``x @ w.T`` uses (the kernel's
        order too, unless the form permutes the inputs)."""
        return self.dequantize()


@dataclass(frozen=True, eq=False)
class IntWeight(_RowMajorWeight):
    """Group-wise integer weight, unpacked (one value per byte), in the kernel's input order."""

    qweight: torch.Tensor  # [out, in] uint8, values in [0, 2**bits)
    scales: torch.Tensor  # [in // group_size, out] float32
    zeros: torch.Tensor  # [in // group_size, out] uint8 integer zero points (symmetric: 2**(bits-1))
    group_size: int  # divides in_features (a per-channel checkpoint: group_size == in_features)
    bits: int  # 4 or 8
    perm: Optional[torch.Tensor] = None  # [in] int64: kernel input k reads checkpoint input perm[k]; None: identity

    def __post_init__(self) -> None:
        out, inp = self.qweight.shape
        assert self.qweight.dtype == torch.uint8, self.qweight.dtype
        assert self.bits in (4, 8), self.bits
        assert self.group_size > 0 and inp % self.group_size == 0, (inp, self.group_size)
        groups = inp // self.group_size
        assert self.scales.shape == (groups, out) and self.scales.dtype == torch.float32, self.scales.shape
        assert self.zeros.shape == (groups, out) and self.zeros.dtype == torch.uint8, self.zeros.shape
        assert self.perm is None or self.perm.shape == (inp,), self.perm

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in float32, in the kernel's input order (exact: small integers times the scales)."""
        groups = torch.arange(self.in_features, device=self.qweight.device) // self.group_size  # [in]
        q = self.qweight.float()
        z = self.zeros.float().t()[:, groups]  # [out, in]
        s = self.scales.t()[:, groups]  # [out, in]
        return (q - z) * s

    def dequantize_checkpoint_order(self) -> torch.Tensor:
        """The weight [out, in] in float32 in the checkpoint's input order: the act-order permutation undone."""
        w = self.dequantize()
        if self.perm is None:
            return w
        restored = torch.empty_like(w)
        restored[:, self.perm] = w
        return restored

    def select_rows(self, order: torch.Tensor) -> IntWeight:
        """The same weight with output rows (and their scales and zeros) in ``order`` (e.g. gated tile order)."""
        return IntWeight(
            self.qweight[order].contiguous(),
            self.scales[:, order].contiguous(),
            self.zeros[:, order].contiguous(),
            self.group_size,
            self.bits,
            self.perm,
        )

    @staticmethod
    def concat(parts: Sequence[IntWeight]) -> IntWeight:
        """Parts of a fused projection ([q | k | v], [gate | up]) stacked along the output rows."""
        first = parts[0]
        for part in parts[1:]:
            if (part.group_size, part.bits, part.in_features) != (first.group_size, first.bits, first.in_features):
                raise ValueError("the parts of a fused projection must share bits, group size and input size")
            same_perm = (part.perm is None and first.perm is None) or (
                part.perm is not None and first.perm is not None and torch.equal(part.perm, first.perm)
            )
            if not same_perm:
                raise ValueError(
                    "the parts of a fused projection have different act-order permutations (g_idx); "
                    "quantize q/k/v and gate/up with the same input order"
                )
        return IntWeight(
            torch.cat([p.qweight for p in parts], dim=0),
            torch.cat([p.scales for p in parts], dim=1),
            torch.cat([p.zeros for p in parts], dim=1),
            first.group_size,
            first.bits,
            first.perm,
        )


@dataclass(frozen=True, eq=False)
class Fp8Weight(_RowMajorWeight):
    """float8 e4m3 weight with one float32 scale per output row."""

    qweight: torch.Tensor  # [out, in] torch.float8_e4m3fn
    scales: torch.Tensor  # [out] float32
    # Static activation scale of a w8a8 checkpoint (a scalar float32); None: dynamic per-token scales. Used by the
    # GPU FP8 GEMM only: CPU kernels and w8a16 GPU kernels never quantize activations.
    input_scale: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        assert self.qweight.dtype == torch.float8_e4m3fn, self.qweight.dtype
        assert self.scales.shape == (self.qweight.shape[0],) and self.scales.dtype == torch.float32, self.scales
        assert self.input_scale is None or self.input_scale.numel() == 1, self.input_scale

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in float32 (exact: every e4m3 value times a float32 scale)."""
        return self.qweight.float() * self.scales.unsqueeze(1)

    def select_rows(self, order: torch.Tensor) -> Fp8Weight:
        return Fp8Weight(self.qweight[order].contiguous(), self.scales[order].contiguous(), self.input_scale)

    @staticmethod
    def concat(parts: Sequence[Fp8Weight]) -> Fp8Weight:
        """Parts of a fused projection stacked along the output rows; static input scales take their maximum (the
        GPU kernel quantizes the shared input once)."""
        scales = [p.input_scale for p in parts if p.input_scale is not None]
        if scales and len(scales) != len(parts):
            raise ValueError("the parts of a fused projection mix static and dynamic activation scales")
        input_scale = torch.stack([s.reshape(()) for s in scales]).max() if scales else None
        return Fp8Weight(
            torch.cat([p.qweight for p in parts], dim=0), torch.cat([p.scales for p in parts], dim=0), input_scale
        )


FP8_E4M3_MAX = 448.0


def quantize_fp8_per_row(weight: torch.Tensor) -> Fp8Weight:
    """Online FP8 (``--quantization fp8`` on a 16/32-bit checkpoint): per-output-row scale = max|w_row| / 448."""
    w32 = weight.detach().float()
    amax = w32.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
    scales = amax / FP8_E4M3_MAX
    q = (w32 / scales.unsqueeze(1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q.contiguous(), scales.contiguous())
