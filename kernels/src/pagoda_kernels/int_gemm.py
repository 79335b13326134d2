"""Weight-only integer GEMM (AWQ / GPTQ, 4 or 8 bits) as a Triton kernel, and its plain-torch reference.

``y[M, N] = x[:, perm] @ W^T (+ bias)`` with ``W[n, k] = (q[n, k] - zeros[k // group_size, n]) * scales[g, n]``,
the canonical form of ``pagoda.quantization.weights.IntWeight`` (``k`` counts the kernel's input order; ``perm``:
GPTQ act order, input ``k`` of the kernel reads column ``perm[k]`` of x).

Layout read by the kernel (:func:`pack_int_weight`, once at load):

* ``qweight``: ``[ceil(K / V), N]`` int32 with ``V = 32 // bits`` values per word along K: word ``[j, n]`` holds
  ``q[n, j*V + i]`` in bits ``i*bits .. i*bits + bits - 1``; K is padded with zero values to a whole word.
  N is the contiguous axis, so a tile's loads are coalesced along N and a decode tile reads each byte once.
* ``scales``: ``[G, N]`` in float16 (or bfloat16) when that holds every scale exactly (AWQ and GPTQ checkpoints
  store float16 scales), else float32; ``zeros``: ``[G, N]`` uint8.
* ``perm``: ``[K]`` int32. The kernel gathers x's columns itself (no ``index_select`` pass before it): at decode
  x is a few rows, so the gather costs nothing next to the weight, and there is no extra launch.

Dequantization happens per tile in registers (:func:`pagoda_kernels.weight_tiles.int_weight_tile`, inside
:mod:`pagoda_kernels.quant_gemm`'s kernel): ``(q - z)`` is an exact small integer, times the scale in float32 is exact
for 16-bit scales, and is rounded once to x's dtype, so the tile equals ``IntWeight.dequantize().to(x.dtype)``
element for element; products accumulate in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
import triton

from pagoda_kernels.gemm_tiles import GemmConfig
from pagoda_kernels.quant_gemm import GemmWeight, launch_gemm
from pagoda_kernels.weight_tiles import INT_WEIGHT


@dataclass(frozen=True, slots=True)
class PackedIntWeight:
    """An integer weight in the kernel's layout (see the module docstring)."""

    qweight: torch.Tensor  # [ceil(K / (32 // bits)), N] int32
    scales: torch.Tensor  # [G, N] float16, bfloat16 or float32
    zeros: torch.Tensor  # [G, N] uint8
    perm: Optional[torch.Tensor]  # [K] int32
    group_size: int
    bits: int
    in_features: int
    # This weight as :func:`pagoda_kernels.quant_gemm.launch_gemm` hands it to the kernel: built once here, not on
    # every call (a GEMM call is on the decode path of every quantized layer).
    gemm: GemmWeight = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        granule = self.group_size if self.scales.shape[0] > 1 else 0  # one group: any K tile lies in it
        gemm = GemmWeight(
            INT_WEIGHT,
            self.qweight,
            self.scales,
            self.out_features,
            self.in_features,
            self.bits,
            self.zeros,
            self.perm,
            self.group_size,
            granule,
        )
        object.__setattr__(self, "gemm", gemm)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]


def _exact_scales(scales: torch.Tensor) -> torch.Tensor:
    """The narrowest of float16, bfloat16 and float32 that holds every scale exactly."""
    for dtype in (torch.float16, torch.bfloat16):
        narrow = scales.to(dtype)
        if torch.equal(narrow.float(), scales):
            return narrow.contiguous()
    return scales.float().contiguous()


def pack_int_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: Optional[torch.Tensor] = None,
) -> PackedIntWeight:
    """Repack the unpacked form (qweight [N, K] uint8, scales [G, N] float32, zeros [G, N] uint8, perm [K]) into
    the kernel's layout on the same device."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n, k = qweight.shape
    if group_size <= 0 or k % group_size != 0:
        raise ValueError(f"group_size {group_size} must divide in_features {k}")
    groups = k // group_size
    if scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(f"scales and zeros must be [{groups}, {n}], got {tuple(scales.shape)}, {tuple(zeros.shape)}")
    per_word = 32 // bits
    words = triton.cdiv(k, per_word)
    padded = torch.zeros((words * per_word, n), dtype=torch.int32, device=qweight.device)
    padded[:k] = qweight.t()  # [K_pad, N]
    values = padded.view(words, per_word, n)
    packed = values[:, 0].clone()  # [words, N]
    for i in range(1, per_word):  # torch shifts int32 as unsigned bits: value 7 << 28 wraps to the sign bit
        packed |= values[:, i] << (i * bits)
    perm32 = None if perm is None else perm.to(device=qweight.device, dtype=torch.int32).contiguous()
    return PackedIntWeight(packed.contiguous(), _exact_scales(scales), zeros.contiguous(), perm32, group_size, bits, k)


def unpack_qweight(weight: PackedIntWeight) -> torch.Tensor:
    """The packed values back as [N, K] uint8 (for tests and checks)."""
    per_word = 32 // weight.bits
    shifts = torch.arange(per_word, device=weight.qweight.device, dtype=torch.int64) * weight.bits
    words = weight.qweight.to(torch.int64) & 0xFFFFFFFF  # [words, N] unsigned
    values = (words[:, None, :] >> shifts[None, :, None]) & ((1 << weight.bits) - 1)  # [words, V, N]
    return values.reshape(-1, weight.out_features)[: weight.in_features].t().to(torch.uint8).contiguous()


def int_gemm(
    x: torch.Tensor,
    weight: PackedIntWeight,
    bias: Optional[torch.Tensor] = None,
    float_output: bool = False,
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """x [..., K] (float16, bfloat16 or float32) -> [..., N] in x's dtype (float32 rounded through x's dtype with
    ``float_output``). ``config``: tiles to use instead of
    :func:`pagoda_kernels.gemm_tiles.gemm_config`'s (tests). Never syncs."""
    return launch_gemm(x, weight.gemm, bias, float_output, config)


class DequantizableWeight(Protocol):
    """What the reference needs of a weight: ``pagoda.quantization.weights.IntWeight`` is one."""

    perm: Optional[torch.Tensor]

    def dequantize(self) -> torch.Tensor: ...


def int_gemm_reference(
    x: torch.Tensor, weight: DequantizableWeight, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Plain-torch specification of :func:`int_gemm` from the unpacked weight: the dequantized weight rounded once
    to x's dtype, x's columns in ``perm`` order, float32 products and sums, bias added, rounded to x's dtype."""
    w = weight.dequantize().to(x.dtype).float()  # [N, K] in the kernel's input order
    xs = x if weight.perm is None else x.index_select(-1, weight.perm.to(x.device))
    y = xs.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
