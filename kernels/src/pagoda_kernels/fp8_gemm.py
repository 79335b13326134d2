"""FP8 (e4m3) weight GEMMs with per-output-row scales, and their plain-torch references.

The weight is ``pagoda.quantization.weights.Fp8Weight``'s: ``W[n, k] = float(q[n, k]) * scales[n]``, q [N, K]
``torch.float8_e4m3fn``, kept as it is ([N, K], K contiguous: what ``torch._scaled_mm`` takes transposed).

* :func:`fp8_scaled_mm` (GPUs with FP8 tensor cores, compute capability >= 8.9): activations quantized to e4m3
  per token (:func:`quantize_fp8_rows`: ``scale = max|x_row| / 448``, one fused Triton pass; or the checkpoint's
  static per-tensor ``input_scale``), then ``torch._scaled_mm`` with row-wise scales (``scale_a`` [M, 1],
  ``scale_b`` [1, N], float32) and the bias in its epilogue. Where a torch build or GPU rejects row-wise
  scaling, the same GEMM runs with unit per-tensor scales into float32 and both scales are applied after it
  (``rowwise=False``).
* :func:`fp8_w8a16_gemm` (every other GPU, and the interpreter): a Triton GEMM that widens the weight bytes to
  x's dtype in registers and applies the row scale in the epilogue; activations stay 16-bit. e4m3 -> float16 is a
  bit shift (sign to bit 15, exponent and mantissa to bits 13..7) and a multiply by 2**8 (the exponent biases
  differ by 8), exact for every value including subnormals; every e4m3 value is exact in bfloat16 too.
"""

from __future__ import annotations

import functools
from typing import Optional

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

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero
_FP8_MAX = tl.constexpr(FP8_MAX)  # the same constants, readable inside kernels
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def widen_e4m3(b, DTYPE: tl.constexpr):
    """float8_e4m3fn bytes (uint8) -> DTYPE, exactly; the two NaN codes (0x7F, 0xFF) give NaN."""
    bits = b.to(tl.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    value = half * 256.0  # exact: a power of two, and e4m3's range sits inside float16's
    value = tl.where((bits & 0x7F) == 0x7F, float("nan"), value)
    return value.to(DTYPE)


@triton.jit
def _fp8_w8a16_kernel(
    x_ptr,  # [M, K], unit last stride
    w_ptr,  # [N, K] uint8 (float8_e4m3fn bits), contiguous
    scale_ptr,  # [N] float32 row scales
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] output, or [SPLIT, M, N] float32 partials
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_valid = rows < M
    col_valid = cols < N
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + cols[None, :].to(tl.int64) * K  # [1, BLOCK_N]
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_valid = offs_k < k_hi
        x = tl.load(x_rows + offs_k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        q = tl.load(w_cols + offs_k[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        w = widen_e4m3(q, x_ptr.dtype.element_ty)
        if UPCAST_DOT:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
    if SPLIT:
        store_partial(acc, rows, cols, M, N, out_ptr)
    else:
        store_output(acc, rows, cols, M, N, out_ptr, stride_om, scale_ptr, bias_ptr, True, HAS_BIAS, ROUND_DTYPE)


def _check_weight(qweight: torch.Tensor, scales: torch.Tensor) -> None:
    if qweight.dim() != 2 or qweight.dtype != torch.float8_e4m3fn or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous [N, K] float8_e4m3fn tensor, got {qweight.dtype}")
    if scales.shape != (qweight.shape[0],) or scales.dtype != torch.float32 or scales.device != qweight.device:
        raise ValueError(f"scales must be float32 [{qweight.shape[0]}] on {qweight.device}")


def _check_bias(bias: Optional[torch.Tensor], n: int, device: torch.device) -> None:
    if bias is not None and (bias.shape != (n,) or bias.device != device or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float [{n}] tensor on {device}, got {bias.dtype} {tuple(bias.shape)}")


def fp8_w8a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    float_output: bool = False,
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """x [..., K] (float16, bfloat16 or float32) @ (qweight [N, K] e4m3 * scales[:, None])^T + bias -> [..., N]
    in x's dtype (float32 rounded through x's dtype with ``float_output``). Triton; never syncs."""
    _check_weight(qweight, scales)
    n, k = qweight.shape
    check_activation(x, k, qweight.device)
    _check_bias(bias, n, x.device)
    rows = as_rows(x)
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=torch.float32 if float_output else x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    cfg = config or gemm_config(x.device, m, n, k, weight_bits=8)
    per_split, splits = split_bounds(k, cfg)
    target = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _fp8_w8a16_kernel[grid](
        rows,
        qweight.view(torch.uint8),
        scales,
        bias if bias is not None else scales,
        target,
        m,
        n,
        k,
        per_split,
        rows.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        ROUND_DTYPE=TL_DTYPES[x.dtype],
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **dot_options(x),
    )
    if splits > 1:
        splitk_reduce(target, out, scales, bias, TL_DTYPES[x.dtype])
    return out.reshape(*x.shape[:-1], n)


def fp8_w8a16_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Plain-torch specification of :func:`fp8_w8a16_gemm`: exact e4m3 values, float32 products and sums, the row
    scale and the bias in float32, rounded once to x's dtype."""
    y = (x.float() @ qweight.float().T) * scales
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def _quantize_fp8_rows_kernel(
    x_ptr,  # [M, K], unit last stride
    q_ptr,  # [M, K] float8_e4m3fn, contiguous
    scale_ptr,  # [M] float32 out: each row's scale
    static_ptr,  # [1] float32 static scale (STATIC)
    K,
    stride_xm,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), _MIN_AMAX), _FP8_MAX)  # IEEE division, as torch
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_fp8_rows(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scales [M, 1] float32) with ``x ~= q * scales``: per row
    ``max|x_row| / 448``, or ``input_scale`` (a one-element float32 tensor) for every row. One Triton launch."""
    rows = as_rows(x)
    m, k = rows.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scales
    if input_scale is not None and (input_scale.numel() != 1 or input_scale.dtype != torch.float32):
        raise ValueError("input_scale must be a one-element float32 tensor")
    block = min(4096 if x.device.type == "cuda" else 64, triton.next_power_of_2(k))
    _quantize_fp8_rows_kernel[(m,)](
        rows,
        q,
        scales,
        input_scale if input_scale is not None else scales,
        k,
        rows.stride(0),
        STATIC=input_scale is not None,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4 if x.device.type == "cuda" else 1,
    )
    return q, scales


def quantize_fp8_rows_reference(
    x: torch.Tensor, input_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification of :func:`quantize_fp8_rows`."""
    x32 = x.reshape(-1, x.shape[-1]).float()
    if input_scale is None:
        scales = x32.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX  # [M, 1]
    else:
        scales = input_scale.float().reshape(1, 1).expand(x32.shape[0], 1).contiguous()
    q = (x32 / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


@functools.cache
def rowwise_scaled_mm_supported(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` takes row-wise scales into ``out_dtype`` on ``device`` (a CUDA device with
    FP8), tried once on a 16x16x16 problem: builds without the CUTLASS row-wise kernel, and some GPU and
    output-dtype pairs, reject it with an error raised before any launch."""
    a = torch.zeros((16, 16), dtype=torch.float8_e4m3fn, device=device)
    scale = torch.ones((16, 1), dtype=torch.float32, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t(), out_dtype=out_dtype)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def fp8_scaled_mm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    input_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    rowwise: bool = True,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype through FP8 tensor cores: x quantized per token (or with the static
    ``input_scale``), ``torch._scaled_mm`` against qweight [N, K] e4m3 with ``scales`` [N]. ``rowwise=False``: unit
    per-tensor scales into float32, both scales applied afterwards. K and N must be multiples of 16."""
    _check_weight(qweight, scales)
    n, k = qweight.shape
    check_activation(x, k, qweight.device)
    _check_bias(bias, n, x.device)
    if k % 16 or n % 16:
        raise ValueError(f"torch._scaled_mm needs K and N divisible by 16, got K={k}, N={n}")
    xq, x_scales = quantize_fp8_rows(x, input_scale)  # [M, K], [M, 1]
    if rowwise:
        # A bias is added after a float32 output (one rounding, as the reference): the load-time probe of row-wise
        # support runs without one, and some cuBLASLt builds refuse a bias with row-wise scales.
        y = torch._scaled_mm(
            xq,
            qweight.t(),  # [K, N], column-major as cuBLASLt wants
            scale_a=x_scales,
            scale_b=scales.view(1, n),
            out_dtype=x.dtype if bias is None else torch.float32,
        )
        if bias is not None:
            y = (y + bias.float()).to(x.dtype)
    else:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        acc = torch._scaled_mm(xq, qweight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        acc = acc * x_scales * scales
        y = (acc if bias is None else acc + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


def fp8_scaled_mm_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    input_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plain-torch specification of :func:`fp8_scaled_mm`: the quantized activations times the e4m3 weight in
    float32, both scales, the bias, rounded once to x's dtype."""
    xq, x_scales = quantize_fp8_rows_reference(x, input_scale)
    y = (xq.float() @ qweight.float().T) * x_scales * scales
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
