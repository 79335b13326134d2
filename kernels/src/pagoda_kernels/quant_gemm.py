"""The weight-quantized GEMM: one Triton kernel for every weight format, its split-K reduction and its launch.

``y[M, N] = x[M, K] @ W^T (+ bias)`` with W dequantized tile by tile inside the kernel (never a dense copy), in
the format of :mod:`pagoda_kernels.weight_tiles` (``INT_WEIGHT``: :mod:`pagoda_kernels.int_gemm`; ``FP8_WEIGHT``:
:mod:`pagoda_kernels.fp8_gemm`); products accumulate in float32 and the epilogue (the FP8 row scales, the bias)
rounds once to x's dtype. The format is a constexpr, so each compiles to its own kernel with only its own loads.

:func:`launch_gemm` is the host side: checks, the output, the tiles (:mod:`pagoda_kernels.gemm_tiles`), the grid
``(row tiles, column tiles, splits)`` and, with more than one split, the ``[splits, M, N]`` float32 workspace that
:func:`splitk_reduce` adds in split order (deterministic, unlike atomics) before the epilogue. It reads only shapes
on the host, so it never syncs with the device and can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from pagoda_kernels.gemm_tiles import GemmConfig, dot_options, gemm_config, split_bounds
from pagoda_kernels.host import unit_last_stride
from pagoda_kernels.weight_tiles import FP8_WEIGHT, fp8_weight_tile, int_weight_tile

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_FP8_FORMAT = tl.constexpr(FP8_WEIGHT)  # the same constant, readable inside the kernel


@triton.jit
def store_output(
    acc,  # [BLOCK_M, BLOCK_N] float32 sums
    rows,  # [BLOCK_M] int64
    cols,  # [BLOCK_N] int32
    M,
    N,
    out_ptr,  # [M, N], unit last stride
    stride_om,
    col_scale_ptr,  # [N] float32 (HAS_COL_SCALE)
    bias_ptr,  # [N] (HAS_BIAS)
    HAS_COL_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,  # the activation dtype: a float32 output is rounded through it first
):
    """The epilogue: ``acc * col_scale[n] + bias[n]`` in float32, rounded once to the activation dtype."""
    col_valid = cols < N
    if HAS_COL_SCALE:
        acc = acc * tl.load(col_scale_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out = acc.to(ROUND_DTYPE).to(out_ptr.dtype.element_ty)  # float_output: rounded to x's dtype, then widened
    mask = (rows < M)[:, None] & col_valid[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=mask)


@triton.jit
def store_partial(acc, rows, cols, M, N, ws_ptr):
    """Split-K: this split's float32 sums into its [M, N] slice of the workspace (program axis 2 = split)."""
    ws = ws_ptr + tl.program_id(2).to(tl.int64) * M * N
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(ws + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _quant_gemm_kernel(
    x_ptr,  # [M, K], unit last stride
    w_ptr,  # INT_WEIGHT: [ceil(K / V), N] int32, V = 32 // BITS values per word along K; FP8_WEIGHT: [N, K] uint8
    s_ptr,  # INT_WEIGHT: [G, N] group scales; FP8_WEIGHT: [N] float32 row scales, applied in the epilogue
    z_ptr,  # [G, N] uint8 zero points (INT_WEIGHT)
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
    FORMAT: tl.constexpr,  # INT_WEIGHT or FP8_WEIGHT
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
    col_valid = cols < N
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + cols[None, :].to(tl.int64) * K  # [1, BLOCK_N]: FP8_WEIGHT's rows of W (dead code for INT_WEIGHT)
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
        if FORMAT == _FP8_FORMAT:
            w = fp8_weight_tile(w_cols, offs_k, k_valid, col_valid, X)
        else:
            w = int_weight_tile(
                w_ptr, s_ptr, z_ptr, k0, k_hi, cols, N, group_size, BITS, TILE_GROUP, BLOCK_K, BLOCK_N, X
            )
        if UPCAST_DOT:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
    if SPLIT:
        store_partial(acc, rows, cols, M, N, out_ptr)
    else:
        has_col_scale: tl.constexpr = FORMAT == _FP8_FORMAT
        store_output(acc, rows, cols, M, N, out_ptr, stride_om, s_ptr, bias_ptr, has_col_scale, HAS_BIAS, ROUND_DTYPE)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr,  # [SPLIT, M, N] float32 partial sums
    out_ptr,  # [M, N], unit last stride
    col_scale_ptr,
    bias_ptr,
    M,
    N,
    SPLIT,
    stride_om,
    HAS_COL_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None] * N + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(SPLIT):  # a fixed order: the result does not depend on scheduling
        acc += tl.load(ws_ptr + (s * M).to(tl.int64) * N + offs, mask=mask, other=0.0)
    store_output(
        acc, rows, cols, M, N, out_ptr, stride_om, col_scale_ptr, bias_ptr, HAS_COL_SCALE, HAS_BIAS, ROUND_DTYPE
    )


def splitk_reduce(ws: torch.Tensor, out: torch.Tensor, col_scale, bias, round_dtype: tl.dtype) -> None:
    """out = (sum over splits of ws) * col_scale + bias, rounded as :func:`store_output` does."""
    split, m, n = ws.shape
    block_m, block_n = min(16, triton.next_power_of_2(m)), 128 if ws.device.type == "cuda" else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _splitk_reduce_kernel[grid](
        ws,
        out,
        col_scale if col_scale is not None else ws,
        bias if bias is not None else ws,
        m,
        n,
        split,
        out.stride(0),
        HAS_COL_SCALE=col_scale is not None,
        HAS_BIAS=bias is not None,
        ROUND_DTYPE=round_dtype,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4 if ws.device.type == "cuda" else 1,
    )


def check_activation(x: torch.Tensor, in_features: int, device: torch.device) -> None:
    """x must be [..., in_features] in a float dtype the kernels take, on the weight's device."""
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., {in_features}], got {tuple(x.shape)}")
    if x.dtype not in TL_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"x is on {x.device}, the weight on {device}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [M, K] with unit last stride (a view when one exists)."""
    return unit_last_stride(x.reshape(-1, x.shape[-1]))


def check_bias(bias: Optional[torch.Tensor], n: int, device: torch.device) -> None:
    """A bias must be a float [n] tensor on the activations' device."""
    if bias is not None and (bias.shape != (n,) or bias.device != device or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float [{n}] tensor on {device}, got {bias.dtype} {tuple(bias.shape)}")


@dataclass(frozen=True, slots=True)
class GemmWeight:
    """A quantized weight as the GEMM kernel reads it (see :mod:`pagoda_kernels.weight_tiles` for the formats)."""

    format: int  # INT_WEIGHT or FP8_WEIGHT
    data: torch.Tensor  # INT_WEIGHT: [ceil(K / (32 // bits)), N] int32 words; FP8_WEIGHT: [N, K] uint8
    scales: torch.Tensor  # INT_WEIGHT: [G, N]; FP8_WEIGHT: [N] float32, applied in the epilogue
    out_features: int
    in_features: int
    bits: int  # stored bits per value: the split-K workspace is sized against the weight's bytes
    zeros: Optional[torch.Tensor] = None  # INT_WEIGHT: [G, N] uint8
    perm: Optional[torch.Tensor] = None  # [K] int32: input k of the kernel reads column perm[k] of x
    group_size: int = 0  # INT_WEIGHT: inputs per scale row
    k_granule: int = 0  # K tiles must not straddle a multiple of this (a quantization group); 0: any K tile


def launch_gemm(
    x: torch.Tensor, weight: GemmWeight, bias: Optional[torch.Tensor], float_output: bool, config: Optional[GemmConfig]
) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias) -> [..., N]`` in x's dtype, or float32 rounded through x's dtype with
    ``float_output``. ``config``: tiles instead of :func:`pagoda_kernels.gemm_tiles.gemm_config`'s (tests)."""
    n, k = weight.out_features, weight.in_features
    check_activation(x, k, weight.data.device)
    check_bias(bias, n, x.device)
    rows = as_rows(x)
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=torch.float32 if float_output else x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    cfg = config or gemm_config(x.device, m, n, k, weight.bits, weight.k_granule)
    per_split, splits = split_bounds(k, cfg)
    target = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    round_dtype, granule = TL_DTYPES[x.dtype], weight.k_granule
    _quant_gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)](
        rows,
        weight.data,
        weight.scales,
        weight.zeros if weight.zeros is not None else weight.data,  # placeholders are never read
        weight.perm if weight.perm is not None else weight.data,
        bias if bias is not None else weight.scales,
        target,
        m,
        n,
        k,
        weight.group_size,
        per_split,
        rows.stride(0),
        out.stride(0),
        FORMAT=weight.format,
        BITS=weight.bits,
        HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        TILE_GROUP=granule == 0 or granule % cfg.block_k == 0,
        ROUND_DTYPE=round_dtype,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **dot_options(x),
    )
    if splits > 1:
        splitk_reduce(target, out, weight.scales if weight.format == FP8_WEIGHT else None, bias, round_dtype)
    return out.reshape(*x.shape[:-1], n)
