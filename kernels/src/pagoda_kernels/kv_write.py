"""Scatter this step's keys and values into the paged KV cache through a slot mapping.

Token ``i`` of the step goes to flat slot ``s = slot_mapping[i]`` of both caches, i.e. to
``kv_cache[0 or 1, s // block_size, s % block_size]``; a negative slot marks a padding row (CUDA-graph
batches are padded to a captured size) and is skipped. An fp8 cache gets the codes of ``key / k_scale`` and
``value / v_scale`` (:mod:`pagoda_kernels.fp8_codes`).

Kernel grid: ``(num_tokens, cdiv(num_kv_heads, BLOCK_H))``. Each program copies a ``[BLOCK_H, BLOCK_D]`` tile
(a few heads of one token) of the key and of the value; the destination slot is read once per program, and a
negative slot masks the whole tile, so a padding row costs one load and no stores. The kernel reads nothing
on the host: it is safe to capture in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagoda_kernels.fp8_codes import FP8_NONE, fp8_encode, fp8_format, kernel_view, quantize_fp8_reference
from pagoda_kernels.host import host_wrapper, unit_last_stride

# Elements of one program's tile: large enough to amortise the slot load, small enough for few registers.
_TILE_ELEMENTS = 2048


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


class _KvWrite(NamedTuple):
    """One checked :func:`write_kv` call."""

    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] int32/int64
    k_scale: float
    v_scale: float


def _write_call(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> _KvWrite:
    """The front of :func:`write_kv` and its reference: shapes, dtypes and the scales checked."""
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
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"k_scale and v_scale must be positive, got {k_scale}, {v_scale}")
    return _KvWrite(key, value, kv_cache, slot_mapping, k_scale, v_scale)


@host_wrapper(_write_call)
def write_kv(call: _KvWrite) -> None:
    """Write ``key``/``value`` rows into ``kv_cache`` in place at their slots; negative slots are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim] (index 0 keys, 1 values); slot_mapping: [num_tokens] int32/int64 flat slot of each token.
    Values are cast to the cache dtype; an fp8 cache gets the codes of key / k_scale and value / v_scale (the
    scales are ignored otherwise). Two tokens with the same (non-negative) slot race: don't.
    """
    num_tokens, num_kv_heads, head_dim = call.key.shape
    if num_tokens == 0:
        return
    if call.kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim (it is written in place, so it cannot be copied)")
    # Row views (e.g. k sliced out of a fused qkv projection) are fine as long as head_dim is contiguous.
    key, value = unit_last_stride(call.key), unit_last_stride(call.value)
    codes = kernel_view(call.kv_cache)
    key_cache, value_cache = codes[0], codes[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _TILE_ELEMENTS // block_d))
    _write_kv_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        key,
        value,
        key_cache,
        value_cache,
        call.slot_mapping.contiguous(),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        float(call.k_scale),
        float(call.v_scale),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=call.kv_cache.shape[2],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        FP8=fp8_format(call.kv_cache.dtype),
    )


@host_wrapper(_write_call)
def write_kv_reference(call: _KvWrite) -> None:
    """Plain-torch :func:`write_kv` (the spec): same arguments, same in-place effect."""
    kv_cache, key, value = call.kv_cache, call.key, call.value
    if fp8_format(kv_cache.dtype) != FP8_NONE:
        key = quantize_fp8_reference(key, call.k_scale, kv_cache.dtype)
        value = quantize_fp8_reference(value, call.v_scale, kv_cache.dtype)
    block_size = kv_cache.shape[2]
    for token, slot in enumerate(call.slot_mapping.tolist()):
        if slot < 0:  # padding row
            continue
        kv_cache[0, slot // block_size, slot % block_size] = key[token].to(kv_cache.dtype)
        kv_cache[1, slot // block_size, slot % block_size] = value[token].to(kv_cache.dtype)
