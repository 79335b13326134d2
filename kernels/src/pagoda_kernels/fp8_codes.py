"""FP8 codes of the KV cache, shared by the cache writer and the attention kernels.

fp8 caches (torch.float8_e4m3fn / float8_e5m2) store ``key / k_scale`` and ``value / v_scale`` as fp8 codes:
saturated to the format's largest finite value (448 / 57344), rounded to nearest even, NaN kept. The kernels see
such a cache as uint8 codes (:func:`kernel_view`) and convert with integer ops (:func:`fp8_encode` in
:mod:`pagoda_kernels.kv_write`, :func:`fp8_decode` in the attention kernels), so the same code runs on every GPU and
in Triton's CPU interpreter, which has no float8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_NONE, FP8_E4M3, FP8_E5M2 = 0, 1, 2  # the FP8 constexpr of the kernels: how a cache's elements are coded


def fp8_format(dtype: torch.dtype) -> int:
    """The kernels' FP8 constant for a cache of ``dtype``: FP8_E4M3, FP8_E5M2, or FP8_NONE (stored as is)."""
    return {torch.float8_e4m3fn: FP8_E4M3, torch.float8_e5m2: FP8_E5M2}.get(dtype, FP8_NONE)


def kernel_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """What the kernels are handed: an fp8 cache's uint8 codes (same strides), any other cache as it is."""
    return kv_cache.view(torch.uint8) if fp8_format(kv_cache.dtype) != FP8_NONE else kv_cache


def quantize_fp8_reference(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Plain-torch fp8 codes of ``x / scale`` in ``dtype`` (the spec of :func:`fp8_encode`)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


@triton.jit
def _encode(
    x, scale, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr, MAGIC: tl.constexpr, NAN: tl.constexpr
):
    # x / scale in float32 (a correctly rounded division, as torch's), saturated.
    y = tl.math.div_rn(x.to(tl.float32), scale)
    a = tl.minimum(tl.abs(y), MAX)  # a NaN y is recoded below, whatever minimum made of it
    bits = a.to(tl.int32, bitcast=True)
    # Normal results: round the fp32 mantissa to MANT bits (ties to even), then rebias the exponent.
    odd = (bits >> (23 - MANT)) & 1
    normal = (bits + (((BIAS - 127) << 23) + (1 << (22 - MANT)) - 1) + odd) >> (23 - MANT)
    # Below the smallest normal 2^(1 - BIAS): adding MAGIC = 2^(24 - BIAS - MANT) rounds a to the subnormal step in
    # the float adder, and the sum's low bits are the code.
    subnormal = (a + MAGIC).to(tl.int32, bitcast=True) - ((127 + 24 - BIAS - MANT) << 23)
    code = tl.where(bits < ((128 - BIAS) << 23), subnormal, normal)
    code = code | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
    code = tl.where(y != y, NAN, code)
    return code.to(tl.uint8)


@triton.jit
def fp8_encode(x, scale, FP8: tl.constexpr):
    """uint8 fp8 codes of ``x / scale`` (FP8_E4M3 or FP8_E5M2): saturated, rounded to nearest even, NaN kept."""
    if FP8 == 1:
        code = _encode(x, scale, 3, 7, 448.0, 16384.0, 0x7F)
    else:
        code = _encode(x, scale, 2, 15, 57344.0, 128.0, 0x7E)
    return code


@triton.jit
def fp8_decode(codes, FP8: tl.constexpr):
    """float16 values of uint8 fp8 codes, exactly: e5m2 is the top byte of the fp16 with its value. e4m3fn's bits
    moved into fp16's fields give value / 256 (exponent bias 7 vs 15, subnormals included): the caller multiplies
    by 256 (see :func:`fp8_read_factor`); its NaN code becomes fp16 NaN."""
    c = codes.to(tl.uint16)
    if FP8 == 1:
        h = ((c & 0x7F) << 7) | ((c & 0x80) << 8)
        h = tl.where((c & 0x7F) == 0x7F, 0x7E00, h)
    else:
        h = c << 8
    return h.to(tl.float16, bitcast=True)


def fp8_read_factor(fp8: int) -> float:
    """What a value from :func:`fp8_decode` must be multiplied by (with the cache's scale)."""
    return 256.0 if fp8 == FP8_E4M3 else 1.0
