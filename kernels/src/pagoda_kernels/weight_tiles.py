"""Weight tiles dequantized in registers, one loader per weight format of :mod:`pagoda_kernels.quant_gemm`.

Each loader returns the ``[BLOCK_K, BLOCK_N]`` tile of ``W^T`` (rows: input features k in the kernel's order,
columns: output features) in the activation dtype, so the GEMM's dot sees it as it would a dense weight.

* ``INT_WEIGHT`` (:mod:`pagoda_kernels.int_gemm`'s layout): ``(q - zero) * scale``. ``(q - z)`` is an exact small
  integer, times the scale in float32 is exact for 16-bit scales, and is rounded once to the activation dtype, so the
  tile equals ``IntWeight.dequantize().to(x.dtype)`` element for element.
* ``FP8_WEIGHT`` (float8_e4m3fn bytes, [N, K]): widened exactly; the per-output-row scale is applied in the epilogue.
  e4m3 -> float16 is a bit shift (sign to bit 15, exponent and mantissa to bits 13..7) and a multiply by 2**8 (the
  exponent biases differ by 8), exact for every value including subnormals; every e4m3 value is exact in bfloat16 too.
"""

from __future__ import annotations

import triton
import triton.language as tl

INT_WEIGHT, FP8_WEIGHT = 0, 1  # the FORMAT constexpr of the GEMM kernel


@triton.jit
def widen_e4m3(b, DTYPE: tl.constexpr):
    """float8_e4m3fn bytes (uint8) -> DTYPE, exactly; the two NaN codes (0x7F, 0xFF) give NaN."""
    bits = b.to(tl.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    value = half * 256.0  # exact: a power of two, and e4m3's range sits inside float16's
    value = tl.where((bits & 0x7F) == 0x7F, float("nan"), value)
    return value.to(DTYPE)


@triton.jit
def fp8_weight_tile(
    w_cols,  # [1, BLOCK_N] pointers to rows n of W ([N, K] uint8: float8_e4m3fn bits, contiguous)
    offs_k,  # [BLOCK_K] inputs k of the tile
    k_valid,  # [BLOCK_K] which of them are read
    col_valid,  # [BLOCK_N] which columns are read
    DTYPE: tl.constexpr,
):
    """Rows ``offs_k`` of W^T at the columns of ``w_cols``, widened to DTYPE (unscaled): [BLOCK_K, BLOCK_N]."""
    q = tl.load(w_cols + offs_k[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0)
    return widen_e4m3(q, DTYPE)


@triton.jit
def int_weight_tile(
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
