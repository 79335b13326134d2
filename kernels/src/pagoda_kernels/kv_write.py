"""Scatter this step's keys and values into the paged KV cache through a slot mapping.

Token ``i`` of the step goes to flat slot ``s = slot_mapping[i]`` of both caches, i.e. to
``kv_cache[0 or 1, s // block_size, s % block_size]``; a negative slot marks a padding row (CUDA-graph
batches are padded to a captured size) and is skipped.

fp8 caches (torch.float8_e4m3fn / float8_e5m2) store ``key / k_scale`` and ``value / v_scale`` as fp8 codes:
saturated to the format's largest finite value (448 / 57344), rounded to nearest even, NaN kept. The kernels see
such a cache as uint8 codes and convert with integer ops (:func:`fp8_encode`, :func:`fp8_decode`, shared with the
attention kernels), so the same code runs on every GPU and in Triton's CPU interpreter, which has no float8.

Kernel grid: ``(num_tokens, cdiv(num_kv_heads, BLOCK_H))``. Each program copies a ``[BLOCK_H, BLOCK_D]`` tile
(a few heads of one token) of the key and of the value; the destination slot is read once per program, and a
negative slot masks the whole tile, so a padding row costs one load and no stores. The kernel reads nothing
on the host: it is safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of one program's tile: large enough to amortise the slot load, small enough for few registers.
_TILE_ELEMENTS = 2048
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


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slot >= 0)
    # Masked lanes (a negative slot) never dereference dst, whatever garbage block/offset it holds.
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + offs_h[:, None] * stride_ch
    dst = dst + offs_d[None, :]
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8 != 0:
        k = fp8_encode(k, k_scale, FP8)
        v = fp8_encode(v, v_scale, FP8)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _check_inputs(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got {key.shape}, {value.shape}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {kv_cache.shape}")
    if tuple(kv_cache.shape[3:]) != tuple(key.shape[1:]):
        raise ValueError(f"key heads/dim {tuple(key.shape[1:])} do not match the cache {tuple(kv_cache.shape[3:])}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` rows into ``kv_cache`` in place at their slots; negative slots are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim] (index 0 keys, 1 values); slot_mapping: [num_tokens] int32/int64 flat slot of each token.
    Values are cast to the cache dtype; an fp8 cache gets the codes of key / k_scale and value / v_scale (the
    scales are ignored otherwise). Two tokens with the same (non-negative) slot race: don't.
    """
    _check_inputs(key, value, kv_cache, slot_mapping)
    _check_scales(k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim (it is written in place, so it cannot be copied)")
    # Row views (e.g. k sliced out of a fused qkv projection) are fine as long as head_dim is contiguous.
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    slot_mapping = slot_mapping.contiguous()
    fp8 = fp8_format(kv_cache.dtype)
    codes = kernel_view(kv_cache)
    key_cache, value_cache = codes[0], codes[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _TILE_ELEMENTS // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        float(k_scale),
        float(v_scale),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        FP8=fp8,
    )


def _check_scales(k_scale: float, v_scale: float) -> None:
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"k_scale and v_scale must be positive, got {k_scale}, {v_scale}")


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch :func:`write_kv` (the spec): same arguments, same in-place effect."""
    _check_inputs(key, value, kv_cache, slot_mapping)
    _check_scales(k_scale, v_scale)
    if fp8_format(kv_cache.dtype) != FP8_NONE:
        key = quantize_fp8_reference(key, k_scale, kv_cache.dtype)
        value = quantize_fp8_reference(value, v_scale, kv_cache.dtype)
    block_size = kv_cache.shape[2]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:  # padding row
            continue
        kv_cache[0, slot // block_size, slot % block_size] = key[token].to(kv_cache.dtype)
        kv_cache[1, slot // block_size, slot % block_size] = value[token].to(kv_cache.dtype)
