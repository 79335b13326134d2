"""Paged decode attention (one query token per sequence) in Triton, flash-decoding style.

Decode attention reads the whole context of every sequence for a single query row per head: it is bound by
the bandwidth of reading K/V out of the paged cache. Two things keep that bandwidth high.

* GQA packing. The ``group = num_heads // num_kv_heads`` query heads that share a KV head are the rows of one
  ``[BLOCK_G, BLOCK_D]`` query tile of a single program, so each K/V byte is read once per KV head (not once per
  query head) and the score and value products are ``tl.dot`` calls (BLOCK_G is padded to 16, the smallest
  dot operand; padded rows are zero and never stored).
* Split-K (flash-decoding). ``num_seqs * num_kv_heads`` programs do not fill a GPU at small batch, so the
  context of every sequence is also cut into ``num_splits`` partitions processed in parallel.

Stage 1, grid ``(num_seqs, num_kv_heads, num_splits)``. Sequence ``s`` attends to ``[lo, hi)`` with
``hi = seq_len`` and ``lo = max(0, hi - sliding_window)``. That range, from the BLOCK_N-aligned position below
``lo``, is cut into num_splits runs of the same whole number of BLOCK_N tiles; program ``(s, h, p)`` walks run
``p`` tile by tile. For each tile it looks up the physical block of every position in the block table
(a tile covers one or more KV blocks: BLOCK_N >= block_size), gathers the ``[BLOCK_N, head_dim]`` K and V
tiles, scores them with scale * log2(e) folded in so ``exp2`` can be used, and updates an online softmax
(running max ``m``, sum ``l`` and fp32 accumulator ``acc`` per query row). It stores ``acc / l`` and the base-2
log-sum-exp ``m + log2(l)`` of its run; an empty run (short or padding sequences) stores lse = -inf and zeros.

Stage 2, grid ``(num_seqs, num_heads)``: merges the runs of one head, weighting each by
``exp2(lse_p - max_p lse_p)``. When every run is empty (seq_len 0, a padding row) the output is zeros.
With num_splits == 1, stage 1 writes the normalised output directly and stage 2 is skipped.

A logit soft cap (Gemma 2) turns each score into ``cap * tanh(score / cap)`` before the mask; the host then leaves
log2(e) out of the score scale and ``soft_cap_log2`` applies it after the tanh. Attention sinks (gpt-oss: one
logit per query head, an extra softmax column whose value is zero) join the softmax's normaliser only, at the end:
in stage 1 when it writes the output directly, else in the merge, the sink being one more "run" with no output.

fp8 caches (float8_e4m3fn / float8_e5m2, see :mod:`pagoda_kernels.kv_write`) are read as uint8 codes and widened
exactly in the tile loads (``fp8_decode``, then q's dtype for the dots); the K scale is folded into the score scale
and the V scale into each run's normalised output.

Nothing is read back to the host: num_splits depends on shapes only (``max_seq_len``, or the block table
width times block_size), and the run length of each sequence is derived from its seq_len inside the kernel,
so the call can be captured in a CUDA graph and is correct for any seq_lens whatever num_splits is.
"""

from __future__ import annotations

import math
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
from pagoda_kernels.host import dot_precision, host_wrapper, sm_count, unit_last_stride

_LOG2E = math.log2(math.e)
_NO_WINDOW = 2**31 - 1  # a sliding window wider than any context
_WAVES = 4  # target programs per SM for the split heuristic (a few resident programs per SM)
_MIN_SPLIT_TOKENS = 128  # a run shorter than this costs more in the merge than it gains in parallelism
_MAX_SPLITS = 64


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_ptr, v_ptr, bt_row_ptr, tile_start, lo, end, kv_head_off, scale_log2, soft_cap,
    stride_kb, stride_kt, offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, SOFT_CAP: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over the BLOCK_N positions starting at tile_start (positions outside [lo, end) masked)."""
    pos = tile_start + offs_n  # [BLOCK_N]
    valid = (pos >= lo) & (pos < end)
    # Block table indirection per position: a tile spans BLOCK_N // BLOCK_SIZE blocks, which may be anywhere.
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head_off  # [BLOCK_N] element offsets
    kv_mask = valid[:, None] & d_mask[None, :]
    # Masked loads also keep stale (even NaN) cache slots past seq_len out of the 0 * x products below.
    k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0)  # [BLOCK_N, BLOCK_D]
    if FP8 != 0:
        k = fp8_decode(k, FP8).to(q.dtype)  # exact; the K scale is in scale_log2
    # Scores in log2 units (scale * log2(e) folded in, in fp32) so the softmax can use exp2.
    # (with SOFT_CAP, scale_log2 is the plain scale: log2(e) comes after the tanh)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
    if SOFT_CAP:
        s = soft_cap_log2(s, soft_cap)
    s = tl.where(valid[None, :], s, float("-inf"))
    # Every tile holds at least one valid position, so m_new is finite and no -inf - -inf appears.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0)  # [BLOCK_N, BLOCK_D]
    if FP8 != 0:
        v = fp8_decode(v, FP8).to(q.dtype)  # exact; the V scale multiplies the normalised output
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr, sinks_ptr,
    scale_log2, window, v_factor, soft_cap,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_bts,
    stride_os, stride_oh, stride_op, stride_ls, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, SOFT_CAP: tl.constexpr,
    SINKS: tl.constexpr,
):  # fmt: skip
    # q: [num_seqs, num_heads, head_dim]; out: [num_seqs, num_heads, num_splits, head_dim] fp32 partials,
    # or [num_seqs, num_heads, head_dim] when DIRECT; lse: [num_seqs, num_heads, num_splits] fp32.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(seq_len - window, 0)
    base = (lo // BLOCK_N) * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - base, BLOCK_N), NUM_SPLITS)
    start = base + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g  # [BLOCK_G] query heads sharing this KV head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    qo_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0)
    # q: [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bts
    for tile_start in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_ptr, v_ptr, bt_row_ptr, tile_start, lo, end, kv_head * stride_kh, scale_log2,
            soft_cap, stride_kb, stride_kt, offs_n, offs_d, d_mask, BLOCK_SIZE, DOT_PRECISION, FP8, SOFT_CAP,
        )  # fmt: skip

    has_keys = l_i > 0.0  # False only for an empty run
    if DIRECT and SINKS:  # the only run: the sinks join its normaliser here (else in the merge)
        result = with_sinks(acc, m_i, l_i, tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * LOG2E)
    else:
        result = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # empty run: 0 / 1 = zeros
    if FP8 != 0:
        result = result * v_factor  # the runs' merge is linear in their outputs
    o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
    if DIRECT:
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        tl.store(o_ptrs + split * stride_op, result, mask=qo_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_ptr, lse_ptr, out_ptr, sinks_ptr,
    stride_ps, stride_ph, stride_pp, stride_ls, stride_lh, stride_os, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    if SINKS:  # the sink is one more run (lse = its logit in log2 units) whose output is zero
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all runs empty: every weight is exp2(-inf) = 0
    weight = tl.exp2(lse - lse_max)  # [BLOCK_S]
    part_ptrs = part_ptr + seq * stride_ps + head * stride_ph + offs_s[:, None] * stride_pp + offs_d[None, :]
    part = tl.load(part_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weight, axis=0)
    if SINKS:
        total += tl.exp2(sink - lse_max)
    result = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, result.to(out_ptr.dtype.element_ty), mask=d_mask)


def _tile_len(block_size: int, block_d: int) -> int:
    # 64 positions of head_dim <= 128 keep the K and V tiles in registers; a tile never splits a KV block.
    return max(block_size, 64 if block_d <= 128 else 32)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Context partitions per sequence so that ``num_seqs * num_kv_heads * num_splits`` fills the GPU.

    Aims at ``_WAVES`` programs per SM, but never cuts runs shorter than ``_MIN_SPLIT_TOKENS`` positions.
    Host-only arithmetic on Python ints (no device reads).
    """
    programs = max(1, num_seqs * num_kv_heads)
    sms = sm_count(device) if device.type == "cuda" else 132  # interpreter: any plausible value (it sizes the grid)
    by_occupancy = triton.cdiv(sms * _WAVES, programs)
    by_length = triton.cdiv(max(1, max_seq_len), _MIN_SPLIT_TOKENS)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


class _Decode(NamedTuple):
    """One checked :func:`paged_decode_attention` call."""

    q: torch.Tensor  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor  # [num_seqs]
    scale: float
    sliding_window: Optional[int]
    max_seq_len: Optional[int]  # a bound on seq_lens that sizes num_splits (launch tuning only)
    num_splits: Optional[int]
    out: Optional[torch.Tensor]
    k_scale: float  # 1.0 unless the cache is fp8 (other caches ignore the scales)
    v_scale: float
    logits_soft_cap: Optional[float]  # scores -> cap * tanh(scores / cap) before the window
    sinks: Optional[torch.Tensor]  # [num_heads]: one extra softmax logit per query head, its value zero

    @property
    def fp8(self) -> int:
        return fp8_format(self.kv_cache.dtype)


def _decode_call(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> _Decode:
    """The front of :func:`paged_decode_attention` and its reference: shapes and dtypes checked (no values read)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != q.shape[2]:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, {q.shape[2]}], got {kv_cache.shape}"
        )
    if q.shape[1] % kv_cache.shape[3] != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {kv_cache.shape[3]}")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables must be [num_seqs={q.shape[0]}, max_blocks], got {tuple(block_tables.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables and seq_lens must be int32/int64, got {block_tables.dtype}, {seq_lens.dtype}")
    if seq_lens.shape != (q.shape[0],):
        raise ValueError(f"seq_lens must be [num_seqs={q.shape[0]}], got {tuple(seq_lens.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    check_soft_cap_and_sinks(q, logits_soft_cap, sinks)
    if fp8_format(kv_cache.dtype) == FP8_NONE:
        k_scale = v_scale = 1.0
    args = (q, kv_cache, block_tables, seq_lens, scale, sliding_window, max_seq_len, num_splits, out)
    return _Decode(*args, k_scale, v_scale, logits_soft_cap, sinks)


@host_wrapper(_decode_call)
def paged_decode_attention(call: _Decode) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context (flash-decoding, two stages).

    q: [num_seqs, num_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks] int32/int64; seq_lens: [num_seqs] (0 = padding row -> zeros).
    The query sits at position seq_len - 1 and attends to [max(0, seq_len - sliding_window), seq_len).
    max_seq_len (a Python int bound on seq_lens) and num_splits only tune the launch; neither changes the
    result. An fp8 cache holds codes of K / k_scale and V / v_scale (plain Python floats, so a CUDA graph keeps
    them); other caches ignore the scales. logits_soft_cap caps every score to cap * tanh(score / cap); sinks
    ([num_heads], any float dtype) add one softmax logit per query head that takes probability and gives no value.
    Returns ``out`` ([num_seqs, num_heads, head_dim], q.dtype), allocated when None.
    """
    num_seqs, num_heads, head_dim = call.q.shape
    block_size, num_kv_heads = call.kv_cache.shape[2], call.kv_cache.shape[3]
    if call.kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    if call.out is not None and call.out.stride(-1) != 1:
        raise ValueError("out must be contiguous in head_dim")
    out = call.out if call.out is not None else torch.empty_like(call.q)
    if num_seqs == 0:
        return out
    q, block_tables = unit_last_stride(call.q), unit_last_stride(call.block_tables)
    seq_lens = call.seq_lens.contiguous()
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_splits = call.num_splits
    if num_splits is None:
        bound = call.max_seq_len if call.max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = default_num_splits(num_seqs, num_kv_heads, bound, q.device)
    if num_splits == 1:
        part, lse = out, out  # stage 1 writes the output itself; lse is unused
    else:
        part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    fp8, v_factor = call.fp8, 1.0
    soft_cap = call.logits_soft_cap is not None
    scale = call.scale if soft_cap else call.scale * _LOG2E  # a soft cap applies log2(e) after its tanh
    if fp8 != FP8_NONE:
        scale, v_factor = scale * call.k_scale * fp8_read_factor(fp8), call.v_scale * fp8_read_factor(fp8)
    codes = kernel_view(call.kv_cache)
    key_cache, value_cache = codes[0], codes[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    window = call.sliding_window if call.sliding_window is not None else _NO_WINDOW
    group = num_heads // num_kv_heads
    sinks = call.sinks if call.sinks is not None else q  # q: a placeholder pointer, never read
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, block_tables, seq_lens, part, lse, sinks, scale, window, v_factor,
        call.logits_soft_cap or 1.0,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2) if num_splits > 1 else 0,
        lse.stride(0) if num_splits > 1 else 0, lse.stride(1) if num_splits > 1 else 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=_tile_len(block_size, block_d), BLOCK_D=block_d,
        DIRECT=num_splits == 1, DOT_PRECISION=dot_precision(q.dtype), FP8=fp8, SOFT_CAP=soft_cap,
        SINKS=call.sinks is not None, num_warps=4, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part, lse, out, sinks,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            SINKS=call.sinks is not None, num_warps=4,
        )  # fmt: skip
    return out


@host_wrapper(_decode_call)
def paged_decode_attention_reference(call: _Decode) -> torch.Tensor:
    """Plain-torch :func:`paged_decode_attention` (the spec): one sequence at a time, fp32 softmax.

    max_seq_len and num_splits are accepted for signature parity and ignored. The soft cap and the sinks follow
    transformers' eager attention of gemma2 and gpt_oss.
    """
    q, kv_cache, block_tables, window = call.q, call.kv_cache, call.block_tables, call.sliding_window
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    result = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for i, seq_len in enumerate(call.seq_lens.tolist()):
        first = 0 if window is None else max(0, seq_len - window)
        pos = torch.arange(first, seq_len, device=q.device)
        blocks = block_tables[i, pos // block_size].long()
        keys = kv_cache[0, blocks, pos % block_size].float() * call.k_scale  # [n, num_kv_heads, head_dim]
        values = kv_cache[1, blocks, pos % block_size].float() * call.v_scale
        if len(pos) == 0:  # padding row: zeros
            continue
        # Query head h reads KV head h // group.
        keys = keys.repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), keys) * call.scale  # [num_heads, n]
        probs = reference_softmax(scores, call.logits_soft_cap, None, call.sinks)
        result[i] = torch.einsum("hn,nhd->hd", probs, values)
    if call.out is None:
        return result.to(q.dtype)
    call.out.copy_(result)
    return call.out
