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

Dequantization happens per tile in registers: ``(q - z)`` is an exact small integer, times the scale in float32
is exact for 16-bit scales, and is rounded once to x's dtype, so the tile equals
``IntWeight.dequantize().to(x.dtype)`` element for element; products accumulate in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import triton
import triton.language as tl

from pagoda_kernels.quant_gemm import (
    TL_DTYPES,
    GemmConfig,
    as_rows,
    check_activation,
    dot_options,
    gemm_config,
    split_bounds,
    splitk_reduce,
    store_output,
    store_partial,
)


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

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]


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


@triton.jit
def _dequantized_tile(
    qw_ptr,  # [ceil(K / V), N] int32 words
    s_ptr,  # [G, N] scales
    z_ptr,  # [G, N] uint8 zero points
    k0,  # first row of the tile
    k_hi,  # rows from here on are masked
    cols,  # [BLOCK_N] int32
    N,
    group_size,
    BITS: tl.constexpr,
    TILE_GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Weight rows k0 .. k0 + BLOCK_K - 1 (kernel order) of columns ``cols``, dequantized: [BLOCK_K, BLOCK_N] DTYPE."""
    PER_WORD: tl.constexpr = 32 // BITS
    VALUE_MASK: tl.constexpr = (1 << BITS) - 1
    col_valid = cols < N
    # Each word is loaded once and split into its PER_WORD values along a new middle axis; merging that axis into
    # K (row-major) puts value i of word j at row j * PER_WORD + i. Loading every row's word instead
    # (offs_k // PER_WORD) compiles to 3.6x the shared memory and 3x the PTX for sm_90 at decode tiles.
    offs_w = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)  # [BLOCK_K / PER_WORD]
    word_mask = (offs_w * PER_WORD < k_hi)[:, None] & col_valid[None, :]  # past K: zero padding, and x is masked
    words = tl.load(qw_ptr + offs_w[:, None] * N + cols[None, :], mask=word_mask, other=0)
    shifts = tl.arange(0, PER_WORD) * BITS  # [PER_WORD]
    values = (words[:, None, :] >> shifts[None, :, None]) & VALUE_MASK  # [BLOCK_K / PER_WORD, PER_WORD, BLOCK_N]
    q = tl.reshape(values, (BLOCK_K, BLOCK_N))  # [BLOCK_K, BLOCK_N] int32
    if TILE_GROUP:
        g_offs = (k0 // group_size) * N + cols[None, :]  # [1, BLOCK_N]: one group row for the whole tile
        zero = tl.load(z_ptr + g_offs, mask=col_valid[None, :], other=0)
        scale = tl.load(s_ptr + g_offs, mask=col_valid[None, :], other=0.0)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w_mask = (offs_k < k_hi)[:, None] & col_valid[None, :]
        g_offs = (offs_k // group_size)[:, None] * N + cols[None, :]  # [BLOCK_K, BLOCK_N]: each row's group
        zero = tl.load(z_ptr + g_offs, mask=w_mask, other=0)
        scale = tl.load(s_ptr + g_offs, mask=w_mask, other=0.0)
    # exact integer, exact float32 product (16-bit scales), one rounding to the activation dtype
    return ((q - zero.to(tl.int32)).to(tl.float32) * scale.to(tl.float32)).to(DTYPE)


@triton.jit
def _int_gemm_kernel(
    x_ptr,  # [M, K], unit last stride
    qw_ptr,  # [ceil(K / V), N] int32, V = 32 // BITS values per word along K
    s_ptr,  # [G, N] scales
    z_ptr,  # [G, N] uint8 zero points
    perm_ptr,  # [K] int32 (HAS_PERM)
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] output, or [SPLIT, M, N] float32 partials
    M,
    N,
    K,
    group_size,
    k_per_split,  # K columns per program along axis 2, a multiple of BLOCK_K
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # write partial sums for _splitk_reduce_kernel
    TILE_GROUP: tl.constexpr,  # every K tile lies in one group: one scale/zero row per tile
    ROUND_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    X: tl.constexpr = x_ptr.dtype.element_ty  # the activation dtype: the dequantized tile's
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_valid = rows < M
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_valid = offs_k < k_hi
        if HAS_PERM:
            src_k = tl.load(perm_ptr + offs_k, mask=k_valid, other=0)  # act order: gather x's columns
        else:
            src_k = offs_k
        # Columns past K load as 0 in x, so whatever the weight holds there adds nothing.
        x = tl.load(x_rows + src_k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = _dequantized_tile(
            qw_ptr, s_ptr, z_ptr, k0, k_hi, cols, N, group_size, BITS, TILE_GROUP, BLOCK_K, BLOCK_N, X
        )
        if UPCAST_DOT:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
    if SPLIT:
        store_partial(acc, rows, cols, M, N, out_ptr)
    else:
        store_output(acc, rows, cols, M, N, out_ptr, stride_om, bias_ptr, bias_ptr, False, HAS_BIAS, ROUND_DTYPE)


def _check_bias(bias: Optional[torch.Tensor], n: int, device: torch.device) -> None:
    if bias is not None and (bias.shape != (n,) or bias.device != device or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float [{n}] tensor on {device}, got {bias.dtype} {tuple(bias.shape)}")


def int_gemm(
    x: torch.Tensor,
    weight: PackedIntWeight,
    bias: Optional[torch.Tensor] = None,
    float_output: bool = False,
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """x [..., K] (float16, bfloat16 or float32) -> [..., N] in x's dtype (float32 rounded through x's dtype with
    ``float_output``). ``config``: tiles to use instead of :func:`gemm_config`'s (tests). Never syncs."""
    check_activation(x, weight.in_features, weight.qweight.device)
    n, k = weight.out_features, weight.in_features
    _check_bias(bias, n, x.device)
    rows = as_rows(x)
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=torch.float32 if float_output else x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    multi_group = weight.num_groups > 1
    cfg = config or gemm_config(x.device, m, n, k, weight.bits, weight.group_size if multi_group else 0)
    per_split, splits = split_bounds(k, cfg)
    target = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _int_gemm_kernel[grid](
        rows,
        weight.qweight,
        weight.scales,
        weight.zeros,
        weight.perm if weight.perm is not None else weight.qweight,
        bias if bias is not None else weight.scales,
        target,
        m,
        n,
        k,
        weight.group_size,
        per_split,
        rows.stride(0),
        out.stride(0),
        BITS=weight.bits,
        HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        TILE_GROUP=not multi_group or weight.group_size % cfg.block_k == 0,
        ROUND_DTYPE=TL_DTYPES[x.dtype],
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **dot_options(x),
    )
    if splits > 1:
        splitk_reduce(target, out, None, bias, TL_DTYPES[x.dtype])
    return out.reshape(*x.shape[:-1], n)


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
