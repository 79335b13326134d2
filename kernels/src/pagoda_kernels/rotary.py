"""Rotate-half rotary position embedding of q and k in one Triton launch, with a torch reference.

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])`` and
cos/sin: [num_tokens, head_dim] in the activation dtype (transformers' ``cat(freqs, freqs)`` layout, but
both halves are read, so any cos/sin table works). The kernel computes each output element in float32
and rounds once; the reference (the engine's ``pagoda.layers.rotary.apply_rotary``) rounds the two
products and the sum separately in the activation dtype, so in bf16/fp16 the two may differ by about
one unit in the last place.

q and k are typically per-head views of a split fused qkv projection, whose rows are longer than
``num_heads * head_dim``: token and head strides are honoured, only head_dim must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels.host import unit_last_stride

# Elements (per half of head_dim) one program rotates; bounds registers for many-head models.
_BLOCK_ELEMS = 4096


@triton.jit
def _rotate_heads(
    x_ptr,  # [num_tokens, num_heads, head_dim], unit stride along head_dim
    out_ptr,  # [num_tokens, num_heads, head_dim] contiguous
    cos1,  # [BLOCK_HALF] fp32, cos[token, :half]
    sin1,
    cos2,  # [BLOCK_HALF] fp32, cos[token, half:]
    sin2,
    token,
    head_start,
    num_heads,
    stride_t,
    stride_h,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = head_start + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < half)
    src = x_ptr + token * stride_t + heads[:, None] * stride_h + cols[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    # Each product is rounded to the activation dtype before the add, as transformers' unfused
    # ``x * cos + rotate_half(x) * sin`` does, so greedy tokens match it bit for bit.
    dt = out_ptr.dtype.element_ty
    out1 = (x1 * cos1[None, :]).to(dt).to(tl.float32) - (x2 * sin1[None, :]).to(dt).to(tl.float32)
    out2 = (x2 * cos2[None, :]).to(dt).to(tl.float32) + (x1 * sin2[None, :]).to(dt).to(tl.float32)
    dst = out_ptr + (token * num_heads + heads[:, None]) * (2 * half) + cols[None, :]
    tl.store(dst, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,  # [num_tokens, head_dim], unit stride along head_dim
    sin_ptr,
    num_q_heads,
    num_k_heads,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    cos_stride_t,
    sin_stride_t,
    half,
    num_q_blocks,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # Grid: (num_tokens, num_q_blocks + num_k_blocks); the second axis walks q's head blocks, then k's.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < half
    cos_row = cos_ptr + token * cos_stride_t + cols
    sin_row = sin_ptr + token * sin_stride_t + cols
    cos1 = tl.load(cos_row, mask=cmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=cmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + half, mask=cmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + half, mask=cmask, other=0.0).to(tl.float32)
    if block < num_q_blocks:
        _rotate_heads(
            q_ptr, q_out_ptr, cos1, sin1, cos2, sin2, token, block * BLOCK_H,
            num_q_heads, q_stride_t, q_stride_h, half, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr, k_out_ptr, cos1, sin1, cos2, sin2, token, (block - num_q_blocks) * BLOCK_H,
            num_k_heads, k_stride_t, k_stride_h, half, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip


def _check_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in num_tokens and head_dim")
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (num_tokens, head_dim):
            raise ValueError(
                f"{name} must be [num_tokens, head_dim] = {(num_tokens, head_dim)}, got {tuple(table.shape)}"
            )
    dtypes = {q.dtype, k.dtype, cos.dtype, sin.dtype}
    if len(dtypes) != 1:
        raise ValueError(f"q, k, cos and sin must share one dtype (the activation dtype), got {dtypes}")
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError("q, k, cos and sin must be on one device")


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q: [num_tokens, num_q_heads, head_dim] and k: [num_tokens, num_kv_heads, head_dim].

    cos, sin: [num_tokens, head_dim] in the same dtype as q and k. Returns new contiguous tensors; the
    inputs are not modified. Computes in float32 and rounds once to the activation dtype.
    """
    _check_args(q, k, cos, sin)
    q, k, cos, sin = (unit_last_stride(t) for t in (q, k, cos, sin))
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0 or head_dim == 0:
        return q_out, k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_k_heads, 1)), max(_BLOCK_ELEMS // block_half, 1))
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    num_k_blocks = triton.cdiv(num_k_heads, block_h)
    if num_q_blocks + num_k_blocks == 0:
        return q_out, k_out
    grid = (num_tokens, num_q_blocks + num_k_blocks)
    _rotary_kernel[grid](
        q, k, q_out, k_out, cos, sin,
        num_q_heads, num_k_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        half, num_q_blocks,
        BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=4 if block_h * block_half >= 1024 else 1,
    )  # fmt: skip
    return q_out, k_out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim], broadcast over heads.
    return (x * cos.unsqueeze(1)) + (_rotate_half(x) * sin.unsqueeze(1))


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch apply_rotary: the engine's ``pagoda.layers.rotary.apply_rotary`` applied to q and to k."""
    _check_args(q, k, cos, sin)
    return _rotate_reference(q, cos, sin), _rotate_reference(k, cos, sin)
