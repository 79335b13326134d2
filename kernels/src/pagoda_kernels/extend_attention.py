"""Extend (chunked-prefill) attention over the paged KV cache, in Triton, next to its torch reference.

A step's batch is flattened: request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i + 1]``
(``q_len`` rows) and, once this step's K/V are written, ``seq_lens[i]`` tokens of context in the cache. Its
query ``j`` sits at position ``seq_lens[i] - q_len + j`` and attends causally to every cached position up to
its own (and, with a sliding window ``W``, only to positions ``> pos - W``). The cached prefix and the chunk
itself are read the same way, through the block table, so the kernel never sees the step's raw K/V. A
``q_len == 1`` row is simply a decode in a mixed batch.

Algorithm (FlashAttention-2 style, one pass, online softmax in fp32 with ``exp2``):

* Grid ``(num_reqs, num_kv_heads, cdiv(max_query_len * group, BLOCK_M))`` with ``group = num_heads //
  num_kv_heads``. A program owns one request, one KV head and a tile of ``BLOCK_M`` *rows*, where the
  ``group`` query heads sharing that KV head are folded into the row axis (row ``r`` is token ``r // group``,
  head ``kv_head * group + r % group``). Each K/V tile is thus loaded once for the whole query group, and a
  decode-like row still fills ``group`` rows of the tile. Programs whose tile starts past the request's
  ``q_len * group`` rows return at once (the grid is sized by the longest request).
* The program walks the context in ``BLOCK_N`` key tiles. Each key position is mapped to its slot through
  the block table (``block_table[pos // block_size] * block_size + pos % block_size``), so ``BLOCK_N`` and
  the cache block size are independent. The walk stops after the last key the tile's last row may see
  (``prefix_len + last_token``) and, with a sliding window, starts at the tile containing the first key
  the tile's first row may see: tiles no row can see are never loaded.
* Scores are masked (causal against each row's position, window when set) to ``-inf``; the running max
  starts at a large finite negative so a row that sees nothing in an early tile stays NaN-free.
* ``head_dim`` is padded to ``BLOCK_D = max(16, next_power_of_2(head_dim))`` (``tl.dot`` needs every dim
  >= 16) with masked loads/stores, so head sizes such as 8 or 96 work.
* A logit soft cap (Gemma 2: ``cap * tanh(s / cap)`` before the mask) is applied to each score tile; the host then
  leaves log2(e) out of ``qk_scale`` and the cap puts it back after the tanh. Sinks (gpt-oss: one logit per query
  head, an extra softmax column whose value is zero) join each row's normaliser at the end.
* An fp8 cache (see :mod:`pagoda_kernels.kv_write`) is read as uint8 codes widened exactly in the tile loads; the
  K scale is folded into ``qk_scale``, the V scale into the final normalisation.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from pagoda_kernels.attention_logits import (
    LOG2E,
    check_soft_cap_and_sinks,
    reference_softmax,
    soft_cap_log2,
    with_sinks,
)
from pagoda_kernels.fp8_codes import FP8_NONE, fp8_decode, fp8_format, fp8_read_factor, kernel_view
from pagoda_kernels.host import dot_precision, host_wrapper, unit_last_stride

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_blocks] int32/int64
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    sinks_ptr,  # [num_heads], only read when SINKS
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain (without log2(e) when SOFT_CAP)
    sliding_window,  # only read when USE_WINDOW
    v_factor,  # only read when FP8: the V scale (times fp8_read_factor)
    soft_cap,  # only read when SOFT_CAP
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # K and V caches share strides (two halves of one tensor)
    stride_cs,
    stride_ch,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    row_lo = tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    num_rows = q_len * GROUP
    if row_lo >= num_rows:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = seq_len - q_len

    rows = row_lo + tl.arange(0, BLOCK_M)
    row_valid = rows < num_rows
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = prefix_len + tok  # [BLOCK_M] position of each row's query token
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    # Keys [lo, hi): hi is one past the last key the tile's last row may see.
    last_tok = (tl.minimum(row_lo + BLOCK_M, num_rows) - 1) // GROUP
    hi = prefix_len + last_tok + 1
    lo = 0
    if USE_WINDOW:
        first_visible = tl.maximum(prefix_len + row_lo // GROUP - sliding_window + 1, 0)
        lo = (first_visible // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(lo, hi, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        pos_valid = pos < hi
        block = tl.load(table_row + pos // KV_BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        kv_offs = (
            block[:, None] * stride_cb
            + (pos % KV_BLOCK_SIZE)[:, None] * stride_cs
            + kv_head * stride_ch
            + offs_d[None, :]
        )
        kv_mask = pos_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0)  # [BLOCK_N, BLOCK_D]
        if FP8 != 0:
            k = fp8_decode(k, FP8).to(q.dtype)  # exact; the K scale is in qk_scale
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFT_CAP:
            s = soft_cap_log2(s, soft_cap)
        # For a real row q_pos < hi, so the causal test also drops the tile's padding keys.
        visible = pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0)  # [BLOCK_N, BLOCK_D]
        if FP8 != 0:
            v = fp8_decode(v, FP8).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Every real row sees at least its own key (l_i > 0); padding rows may see none and are not stored.
    if SINKS:
        out = with_sinks(acc, m_i, l_i, tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * LOG2E)
    else:
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
    if FP8 != 0:
        out = out * v_factor
    o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _tile_config(device: torch.device, max_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a launch whose longest request has ``max_rows`` folded rows."""
    if device.type != "cuda":
        # Triton interpreter: small tiles keep numpy's work per op small and let small test shapes
        # still span several query and key tiles.
        return 16, 16, 1
    block_m = min(64, max(16, triton.next_power_of_2(max_rows)))
    return block_m, 64, 4


class _Extend(NamedTuple):
    """One checked :func:`paged_extend_attention` call."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32/int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    max_query_len: int
    scale: float
    sliding_window: Optional[int]
    out: Optional[torch.Tensor]
    k_scale: float  # 1.0 unless the cache is fp8 (other caches ignore the scales)
    v_scale: float
    logits_soft_cap: Optional[float]  # scores -> cap * tanh(scores / cap) before the mask
    sinks: Optional[torch.Tensor]  # [num_heads]: one extra softmax logit per query head, its value zero


def _extend_call(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> _Extend:
    """The front of :func:`paged_extend_attention` and its reference: shapes and dtypes checked (no device->host
    sync); raises ValueError on bad input."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, kv_cache has {kv_cache.shape[4]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    fp8 = fp8_format(kv_cache.dtype)
    if kv_cache.dtype != q.dtype and fp8 == FP8_NONE:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from q dtype {q.dtype} (and is not fp8)")
    num_reqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"need seq_lens [num_reqs] and query_start_loc [num_reqs + 1], got "
            f"{tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_reqs:
        raise ValueError(f"block_tables must be [num_reqs, max_blocks], got {tuple(block_tables.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be int32 or int64, got {block_tables.dtype}")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative Python int, got {max_query_len!r}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got ({tuple(out.shape)}, {out.dtype})")
    check_soft_cap_and_sinks(q, logits_soft_cap, sinks)
    if fp8 == FP8_NONE:
        k_scale = v_scale = 1.0
    batch = (q, kv_cache, block_tables, query_start_loc, seq_lens, max_query_len)
    return _Extend(*batch, scale, sliding_window, out, k_scale, v_scale, logits_soft_cap, sinks)


@host_wrapper(_extend_call)
def paged_extend_attention(call: _Extend) -> torch.Tensor:
    """Causal attention of a varlen batch of query chunks over their paged context (Triton).

    q: [num_tokens, num_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] already
    holding this step's K/V; block_tables: [num_reqs, max_blocks] int32/int64; query_start_loc: [num_reqs + 1]
    int32; seq_lens: [num_reqs] int32 (cached prefix + chunk); max_query_len: a Python int >= every request's
    query length (it sizes the grid; a smaller value leaves rows unwritten). Returns (or fills) out
    [num_tokens, num_heads, head_dim] in q.dtype; rows past query_start_loc[-1] are left untouched. kv_cache is
    in q's dtype, or fp8 holding codes of K / k_scale and V / v_scale (other caches ignore the scales).
    logits_soft_cap caps every score to cap * tanh(score / cap); sinks ([num_heads], any float dtype) add one softmax
    logit per query head that takes probability and gives no value. Never syncs with the device.
    """
    out = call.out if call.out is not None else torch.empty_like(call.q)
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous in its last dimension")
    num_reqs, max_query_len = call.seq_lens.shape[0], call.max_query_len
    num_heads, head_dim = call.q.shape[1], call.q.shape[2]
    _, _, block_size, num_kv_heads, _ = call.kv_cache.shape
    group = num_heads // num_kv_heads
    if num_reqs == 0 or max_query_len == 0 or call.q.shape[0] == 0:
        return out
    q = unit_last_stride(call.q)
    if call.kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    fp8 = fp8_format(call.kv_cache.dtype)
    soft_cap = call.logits_soft_cap is not None
    qk_scale, v_factor = call.scale * (1.0 if soft_cap else _LOG2E), 1.0  # a soft cap applies log2(e) after its tanh
    if fp8 != FP8_NONE:
        qk_scale, v_factor = qk_scale * call.k_scale * fp8_read_factor(fp8), call.v_scale * fp8_read_factor(fp8)
    codes = kernel_view(call.kv_cache)
    k_cache, v_cache = codes[0], codes[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_m, block_n, num_warps = _tile_config(q.device, max_query_len * group)
    grid = (num_reqs, num_kv_heads, triton.cdiv(max_query_len * group, block_m))
    _extend_attention_kernel[grid](
        q, k_cache, v_cache, out, call.block_tables, call.query_start_loc, call.seq_lens,
        call.sinks if call.sinks is not None else q,  # q: a placeholder pointer, never read
        qk_scale, call.sliding_window or 0, v_factor, call.logits_soft_cap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), call.block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, KV_BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), USE_WINDOW=call.sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype), FP8=fp8, SOFT_CAP=soft_cap, SINKS=call.sinks is not None,
        num_warps=num_warps,
    )  # fmt: skip
    return out


@host_wrapper(_extend_call)
def paged_extend_attention_reference(call: _Extend) -> torch.Tensor:
    """Plain-torch specification of :func:`paged_extend_attention` (same signature; loops over requests).

    Gathers each request's whole context through its block table, then runs an explicitly masked
    softmax in fp32 (soft cap and sinks as transformers' gemma2 / gpt_oss eager attention). Syncs with the device
    (it reads the lengths on the host).
    """
    q, kv_cache, window, max_query_len = call.q, call.kv_cache, call.sliding_window, call.max_query_len
    out = call.out if call.out is not None else torch.empty_like(q)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    starts = call.query_start_loc.tolist()
    for i, seq_len in enumerate(call.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if not 0 <= q_len <= min(max_query_len, seq_len):
            raise ValueError(f"request {i}: query length {q_len} vs seq_len {seq_len}, max_query_len {max_query_len}")
        if q_len == 0:
            continue
        k_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
        blocks = call.block_tables[i, k_pos // block_size].long()
        keys = kv_cache[0, blocks, k_pos % block_size].float() * call.k_scale  # [seq_len, num_kv_heads, head_dim]
        values = kv_cache[1, blocks, k_pos % block_size].float() * call.v_scale
        keys = keys.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]: head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * call.scale  # [num_heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]  # [q_len, 1]
        visible = k_pos[None, :] <= q_pos
        if window is not None:
            visible &= k_pos[None, :] > q_pos - window
        probs = reference_softmax(scores, call.logits_soft_cap, visible, call.sinks)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
