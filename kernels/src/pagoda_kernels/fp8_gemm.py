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
  x's dtype in registers, exactly (:func:`pagoda_kernels.weight_tiles.widen_e4m3`), and applies the row scale in
  the epilogue; activations stay 16-bit. It is :mod:`pagoda_kernels.quant_gemm`'s kernel with ``FP8_WEIGHT`` tiles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from pagoda_kernels.gemm_tiles import GemmConfig
from pagoda_kernels.host import host_wrapper
from pagoda_kernels.quant_gemm import GemmWeight, as_rows, check_activation, check_bias, launch_gemm
from pagoda_kernels.weight_tiles import FP8_WEIGHT

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero
_FP8_MAX = tl.constexpr(FP8_MAX)  # the same constants, readable inside kernels
_MIN_AMAX = tl.constexpr(MIN_AMAX)


def _check_weight(qweight: torch.Tensor, scales: torch.Tensor) -> None:
    if qweight.dim() != 2 or qweight.dtype != torch.float8_e4m3fn or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous [N, K] float8_e4m3fn tensor, got {qweight.dtype}")
    if scales.shape != (qweight.shape[0],) or scales.dtype != torch.float32 or scales.device != qweight.device:
        raise ValueError(f"scales must be float32 [{qweight.shape[0]}] on {qweight.device}")


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
    weight = GemmWeight(FP8_WEIGHT, qweight.view(torch.uint8), scales, n, k, bits=8)
    return launch_gemm(x, weight, bias, float_output, config)


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


@functools.cache
def tensorwise_scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes unit per-tensor scales into float32 on ``device``: the configuration of
    ``fp8_scaled_mm(..., rowwise=False)``, tried once on a 16x16x16 problem as :func:`rowwise_scaled_mm_supported`."""
    a = torch.zeros((16, 16), dtype=torch.float8_e4m3fn, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def rowwise_out_dtype(x_dtype: torch.dtype, has_bias: bool) -> torch.dtype:
    """The ``out_dtype`` a row-wise :func:`fp8_scaled_mm` asks ``torch._scaled_mm`` for: x's dtype, or float32 when
    there is a bias (added after the GEMM, rounded once). Row-wise is only used where
    :func:`rowwise_scaled_mm_supported` approved exactly this dtype."""
    return torch.float32 if has_bias else x_dtype


class _ScaledMm(NamedTuple):
    """One checked :func:`fp8_scaled_mm` call."""

    x: torch.Tensor  # [..., K]
    qweight: torch.Tensor  # [N, K] float8_e4m3fn
    scales: torch.Tensor  # [N] float32
    input_scale: Optional[torch.Tensor]  # [1] float32, or None: per-token scales
    bias: Optional[torch.Tensor]  # [N]
    rowwise: bool


def _scaled_mm_call(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    input_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    rowwise: bool = True,
) -> _ScaledMm:
    """The front of :func:`fp8_scaled_mm` and its reference: the weight, x and the bias checked."""
    _check_weight(qweight, scales)
    check_activation(x, qweight.shape[1], qweight.device)
    check_bias(bias, qweight.shape[0], x.device)
    return _ScaledMm(x, qweight, scales, input_scale, bias, rowwise)


def _scaled(acc: torch.Tensor, x_scales: torch.Tensor, call: _ScaledMm) -> torch.Tensor:
    """float32 products [M, N] of the codes -> both scales and the bias applied in float32, rounded once to x's
    dtype, in x's leading shape."""
    acc = acc * x_scales * call.scales
    y = (acc if call.bias is None else acc + call.bias.float()).to(call.x.dtype)
    return y.reshape(*call.x.shape[:-1], call.qweight.shape[0])


@host_wrapper(_scaled_mm_call)
def fp8_scaled_mm(call: _ScaledMm) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype through FP8 tensor cores: x quantized per token (or with the static
    ``input_scale``), ``torch._scaled_mm`` against qweight [N, K] e4m3 with ``scales`` [N]. ``rowwise=False``: unit
    per-tensor scales into float32, both scales applied afterwards. K and N must be multiples of 16."""
    x, qweight, bias = call.x, call.qweight, call.bias
    n, k = qweight.shape
    if k % 16 or n % 16:
        raise ValueError(f"torch._scaled_mm needs K and N divisible by 16, got K={k}, N={n}")
    xq, x_scales = quantize_fp8_rows(x, call.input_scale)  # [M, K], [M, 1]
    if not call.rowwise:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        return _scaled(
            torch._scaled_mm(xq, qweight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32), x_scales, call
        )
    # A bias is added after a float32 output (one rounding, as the reference): the load-time probe runs without
    # one, and some cuBLASLt builds refuse a bias with row-wise scales. Callers pass rowwise=True only where the
    # probe approved rowwise_out_dtype(...) itself (Fp8GpuLinear does).
    y = torch._scaled_mm(
        xq,
        qweight.t(),  # [K, N], column-major as cuBLASLt wants
        scale_a=x_scales,
        scale_b=call.scales.view(1, n),
        out_dtype=rowwise_out_dtype(x.dtype, bias is not None),
    )
    if bias is not None:
        y = (y + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


@host_wrapper(_scaled_mm_call)
def fp8_scaled_mm_reference(call: _ScaledMm) -> torch.Tensor:
    """Plain-torch specification of :func:`fp8_scaled_mm`: the quantized activations times the e4m3 weight in
    float32, both scales, the bias, rounded once to x's dtype (``rowwise`` is accepted for signature parity)."""
    xq, x_scales = quantize_fp8_rows_reference(call.x, call.input_scale)
    return _scaled(xq.float() @ call.qweight.float().T, x_scales, call)
