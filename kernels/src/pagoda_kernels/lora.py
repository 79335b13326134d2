"""Batched multi-LoRA (Punica / S-LoRA style) shrink and expand, as Triton kernels and in torch.

One LoRA-wrapped linear layer with ``num_slices`` output slices (fused q/k/v: 3, gate/up: 2, o/down: 1) of
sizes ``output_slices`` (summing to ``out_features``) holds, for every adapter slot:

* ``lora_a``: ``[max_loras, num_slices * max_rank, in_features]``; rows ``s * max_rank:(s + 1) * max_rank`` are
  slice ``s``'s A, zero-padded past the adapter's rank.
* ``lora_b``: ``[max_loras, out_features, max_rank]``; rows ``off_s:off_s + output_slices[s]`` are slice ``s``'s
  B, with the LoRA scaling already multiplied in.

A step's tokens are grouped by adapter once (:func:`lora_segments`) and the mapping is shared by every layer:
segment ``i`` covers ``sorted_token_ids[segment_starts[i]:segment_starts[i + 1]]`` and uses adapter slot
``segment_slots[i]`` (-1: unused). Base-model tokens belong to no segment and are left alone.

``lora_shrink`` computes ``shrunk[t] = x[t] @ lora_a[slot].T`` (fp32) for all slices at once: the A rows of
all slices are contiguous, so it is one gather-GEMM. ``lora_expand`` adds ``shrunk[t, s*R:(s+1)*R] @
lora_b[slot, slice s].T`` to ``out[t, slice s]`` in fp32, rounding once to ``out``'s dtype.

Grids are ``(max_loras, cdiv(num_tokens, BLOCK_M), column tiles)`` whatever the mapping holds: a program
returns at once when its segment is unused or shorter than its row tile, so launches never read the mapping
on the host (no device sync; CUDA-graph friendly). ``tl.dot`` needs every dimension >= 16, so the rank is
padded to ``BLOCK_R >= 16`` with masked loads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagoda_kernels.host import dot_precision, host_wrapper, unit_last_stride


@triton.jit
def _segment_rows(token_ids_ptr, seg_starts_ptr, seg_slots_ptr, BLOCK_M: tl.constexpr):
    """(slot, token rows [BLOCK_M] int64, row mask, whether the program has nothing to do) of this tile."""
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    start = tl.load(seg_starts_ptr + seg)
    seg_len = tl.load(seg_starts_ptr + seg + 1) - start
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < seg_len
    tok = tl.load(token_ids_ptr + start + rows, mask=row_valid, other=0).to(tl.int64)
    idle = (slot < 0) | (tl.program_id(1) * BLOCK_M >= seg_len)
    return slot, tok, row_valid, idle


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in_features], unit last stride
    a_ptr,  # [max_loras, N, in_features], N = num_slices * max_rank, unit last stride
    out_ptr,  # [num_tokens, N] float32, unit last stride, zero-filled
    token_ids_ptr,  # [num_tokens] int32
    seg_starts_ptr,  # [max_loras + 1] int32
    seg_slots_ptr,  # [max_loras] int32
    N,
    K,  # in_features
    stride_xt,
    stride_al,
    stride_an,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # multiply fp32 copies (the interpreter cannot dot bf16)
):
    slot, tok, row_valid, idle = _segment_rows(token_ids_ptr, seg_starts_ptr, seg_slots_ptr, BLOCK_M)
    if idle:
        return
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of A = columns of shrunk
    col_valid = cols < N
    x_rows = x_ptr + tok[:, None] * stride_xt  # [BLOCK_M, 1]
    a_cols = a_ptr + slot * stride_al + cols[None, :].to(tl.int64) * stride_an  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        # Masked-out K columns load as 0 on both sides, so they add nothing to the dot.
        x = tl.load(x_rows + offs_k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        a = tl.load(a_cols + offs_k[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
    out_offs = tok[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptr + out_offs, acc, mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [num_tokens, out_features], unit last stride; updated in place
    shrunk_ptr,  # [num_tokens, num_slices * RANK] float32, unit last stride
    b_ptr,  # [max_loras, out_features, RANK], unit last stride
    token_ids_ptr,  # [num_tokens] int32
    seg_starts_ptr,  # [max_loras + 1] int32
    seg_slots_ptr,  # [max_loras] int32
    stride_ot,
    stride_st,
    stride_bl,
    stride_bn,
    RANK: tl.constexpr,
    SLICE_SIZES: tl.constexpr,  # tuple of output slice sizes
    TILES_PER_SLICE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    slot, tok, row_valid, idle = _segment_rows(token_ids_ptr, seg_starts_ptr, seg_slots_ptr, BLOCK_M)
    # Axis 2 enumerates (slice, column tile of that slice), so a tile never straddles two slices and one
    # dot against that slice's shrunk columns covers it. The sizes are compile-time, so this unrolls.
    slice_id = tl.program_id(2) // TILES_PER_SLICE
    n_lo = (tl.program_id(2) % TILES_PER_SLICE) * BLOCK_N
    slice_size = 0
    slice_off = 0
    for i in tl.static_range(len(SLICE_SIZES)):
        slice_size += tl.where(slice_id == i, SLICE_SIZES[i], 0)
        slice_off += tl.where(slice_id > i, SLICE_SIZES[i], 0)
    if idle | (n_lo >= slice_size):
        return
    cols = n_lo + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns within the slice
    col_valid = cols < slice_size
    out_cols = (slice_off + cols).to(tl.int64)  # [BLOCK_N] columns of out and rows of B
    s_rows = shrunk_ptr + tok[:, None] * stride_st + slice_id * RANK  # [BLOCK_M, 1]
    b_rows = b_ptr + slot * stride_bl + out_cols[None, :] * stride_bn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in tl.static_range(0, RANK, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_valid = offs_r < RANK  # BLOCK_R >= 16 pads small ranks; padding loads 0
        s = tl.load(s_rows + offs_r[None, :], mask=row_valid[:, None] & r_valid[None, :], other=0.0)
        b = tl.load(b_rows + offs_r[:, None], mask=r_valid[:, None] & col_valid[None, :], other=0.0)
        acc += tl.dot(s, b.to(tl.float32), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_R] @ [BLOCK_R, BLOCK_N]
    mask = row_valid[:, None] & col_valid[None, :]
    out_ptrs = out_ptr + tok[:, None] * stride_ot + out_cols[None, :]
    prev = tl.load(out_ptrs, mask=mask, other=0.0)
    # Add in fp32 and round once, like (out.float() + delta).to(out.dtype).
    tl.store(out_ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


class _Mapping(NamedTuple):
    """A step's token grouping (see :func:`lora_segments`), as the kernels take it."""

    sorted_token_ids: torch.Tensor  # [num_tokens] int32
    segment_starts: torch.Tensor  # [max_loras + 1] int32
    segment_slots: torch.Tensor  # [max_loras] int32

    def checked(self, num_tokens: int, max_loras: int, device: torch.device) -> _Mapping:
        """Shapes, dtypes and devices (never the values: that would sync)."""
        expected = {
            "sorted_token_ids": (num_tokens,),
            "segment_starts": (max_loras + 1,),
            "segment_slots": (max_loras,),
        }
        for (name, shape), t in zip(expected.items(), self):
            if t.shape != shape or t.dtype != torch.int32 or t.device != device:
                raise ValueError(
                    f"{name} must be int32 {shape} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        return self

    def segments(self) -> list[tuple[torch.Tensor, int]]:
        """(token ids, slot) of every used, non-empty segment (reads the mapping on the host: references only)."""
        starts, slots = self.segment_starts.tolist(), self.segment_slots.tolist()
        used = [
            (slot, starts[i], starts[i + 1]) for i, slot in enumerate(slots) if slot >= 0 and starts[i + 1] > starts[i]
        ]
        return [(self.sorted_token_ids[start:end].long(), slot) for slot, start, end in used]


class _Shrink(NamedTuple):
    """One checked :func:`lora_shrink` call."""

    x: torch.Tensor  # [num_tokens, in_features]
    lora_a: torch.Tensor  # [max_loras, num_slices * max_rank, in_features]
    mapping: _Mapping


def _shrink_call(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    segment_starts: torch.Tensor,
    segment_slots: torch.Tensor,
) -> _Shrink:
    """The front of :func:`lora_shrink` and its reference."""
    if x.dim() != 2 or lora_a.dim() != 3:
        raise ValueError(
            f"need x [num_tokens, in_features] and lora_a [max_loras, num_slices * max_rank, in_features], "
            f"got {tuple(x.shape)} and {tuple(lora_a.shape)}"
        )
    if lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"in_features mismatch: x has {x.shape[1]}, lora_a has {lora_a.shape[2]}")
    if lora_a.dtype != x.dtype or lora_a.device != x.device:
        raise ValueError(f"lora_a ({lora_a.dtype}, {lora_a.device}) must match x ({x.dtype}, {x.device})")
    mapping = _Mapping(sorted_token_ids, segment_starts, segment_slots)
    return _Shrink(x, lora_a, mapping.checked(x.shape[0], lora_a.shape[0], x.device))


class _Expand(NamedTuple):
    """One checked :func:`lora_expand` call."""

    out: torch.Tensor  # [num_tokens, out_features], updated in place
    shrunk: torch.Tensor  # [num_tokens, num_slices * max_rank] float32
    lora_b: torch.Tensor  # [max_loras, out_features, max_rank]
    output_slices: tuple[int, ...]
    mapping: _Mapping


def _expand_call(
    out: torch.Tensor,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    output_slices: tuple[int, ...],
    sorted_token_ids: torch.Tensor,
    segment_starts: torch.Tensor,
    segment_slots: torch.Tensor,
) -> _Expand:
    """The front of :func:`lora_expand` and its reference."""
    if out.dim() != 2 or shrunk.dim() != 2 or lora_b.dim() != 3:
        raise ValueError(
            f"need out [num_tokens, out_features], shrunk [num_tokens, num_slices * max_rank] and lora_b "
            f"[max_loras, out_features, max_rank], got {tuple(out.shape)}, {tuple(shrunk.shape)}, {tuple(lora_b.shape)}"
        )
    if len(output_slices) == 0 or any(int(n) <= 0 for n in output_slices):
        raise ValueError(f"output_slices must be positive sizes, got {output_slices!r}")
    num_tokens, out_features = out.shape
    max_rank = lora_b.shape[2]
    if sum(output_slices) != out_features or lora_b.shape[1] != out_features:
        raise ValueError(
            f"out_features mismatch: out has {out_features}, lora_b has {lora_b.shape[1]}, "
            f"output_slices {tuple(output_slices)} sum to {sum(output_slices)}"
        )
    if shrunk.shape != (num_tokens, len(output_slices) * max_rank) or shrunk.dtype != torch.float32:
        raise ValueError(
            f"shrunk must be float32 ({num_tokens}, {len(output_slices)} * {max_rank}), "
            f"got {shrunk.dtype} {tuple(shrunk.shape)}"
        )
    if lora_b.dtype != out.dtype or lora_b.device != out.device or shrunk.device != out.device:
        raise ValueError(f"lora_b and shrunk must be on {out.device} and lora_b in {out.dtype}")
    if out.stride(1) != 1:
        raise ValueError("out must be contiguous in its last dimension (it is updated in place)")
    mapping = _Mapping(sorted_token_ids, segment_starts, segment_slots).checked(num_tokens, lora_b.shape[0], out.device)
    return _Expand(out, shrunk, lora_b, tuple(output_slices), mapping)


def _tile_config(device: torch.device, num_tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a launch over ``num_tokens`` tokens."""
    if device.type != "cuda":
        # Triton interpreter: small tiles keep numpy's work small and let test shapes span several tiles.
        return 16, 16, 32, 1
    return min(64, max(16, triton.next_power_of_2(num_tokens))), 64, 64, 4


@host_wrapper(_shrink_call)
def lora_shrink(call: _Shrink) -> torch.Tensor:
    """x: [num_tokens, in_features] -> new float32 [num_tokens, num_slices * max_rank] (one launch, Triton).

    Row ``t`` of a token in segment ``i`` is ``x[t] @ lora_a[segment_slots[i]].T`` accumulated in fp32; rows
    of tokens in no segment are 0. lora_a: [max_loras, num_slices * max_rank, in_features] in x.dtype.
    Never syncs with the device.
    """
    x, lora_a = call.x, call.lora_a
    num_tokens, in_features = x.shape
    max_loras, n = lora_a.shape[0], lora_a.shape[1]
    shrunk = torch.zeros((num_tokens, n), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or max_loras == 0 or n == 0 or in_features == 0:
        return shrunk
    x = unit_last_stride(x)
    if lora_a.stride(2) != 1:
        raise ValueError("lora_a must be contiguous in its last dimension")
    block_m, block_n, block_k, num_warps = _tile_config(x.device, num_tokens)
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    grid = (max_loras, triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))
    # Triton's interpreter multiplies bf16 tiles as their raw uint16 bits; fp32 copies give the same exact products
    # a bf16 dot accumulates in fp32, so only the interpreter pays for the upcast.
    upcast = x.device.type != "cuda" and x.dtype == torch.bfloat16
    _lora_shrink_kernel[grid](
        x, lora_a, shrunk, *call.mapping, n, in_features, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        shrunk.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=dot_precision(x.dtype),
        UPCAST_DOT=upcast, num_warps=num_warps,
    )  # fmt: skip
    return shrunk


@host_wrapper(_expand_call)
def lora_expand(call: _Expand) -> None:
    """out[t, slice s] += shrunk[t, s*R:(s+1)*R] @ lora_b[slot, slice s].T for every segmented token (Triton).

    out: [num_tokens, out_features] (rows may be strided, unit last stride), updated in place: the fp32 sum
    is added to out in fp32 and rounded once. shrunk: [num_tokens, num_slices * max_rank] float32;
    lora_b: [max_loras, out_features, max_rank] in out.dtype. All slices in one launch; tokens in no
    segment are untouched. Never syncs with the device.
    """
    out, lora_b, output_slices = call.out, call.lora_b, call.output_slices
    num_tokens = out.shape[0]
    max_loras, _, max_rank = lora_b.shape
    if num_tokens == 0 or max_loras == 0 or max_rank == 0:
        return
    shrunk = unit_last_stride(call.shrunk)
    if lora_b.stride(2) != 1:
        raise ValueError("lora_b must be contiguous in its last dimension")
    block_m, block_n, _, num_warps = _tile_config(out.device, num_tokens)
    block_n = min(block_n, max(16, triton.next_power_of_2(max(output_slices))))
    tiles_per_slice = triton.cdiv(max(output_slices), block_n)
    grid = (max_loras, triton.cdiv(num_tokens, block_m), len(output_slices) * tiles_per_slice)
    _lora_expand_kernel[grid](
        out, shrunk, lora_b, *call.mapping, out.stride(0), shrunk.stride(0), lora_b.stride(0), lora_b.stride(1),
        RANK=max_rank, SLICE_SIZES=tuple(int(n) for n in output_slices), TILES_PER_SLICE=tiles_per_slice,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=min(64, max(16, triton.next_power_of_2(max_rank))),
        DOT_PRECISION=dot_precision(out.dtype), num_warps=num_warps,
    )  # fmt: skip


@host_wrapper(_shrink_call)
def lora_shrink_reference(call: _Shrink) -> torch.Tensor:
    """Plain-torch specification of :func:`lora_shrink` (same signature; loops over segments, syncs)."""
    x, lora_a = call.x, call.lora_a
    shrunk = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    for toks, slot in call.mapping.segments():
        shrunk[toks] = x[toks].float() @ lora_a[slot].float().T  # [seg_len, num_slices * max_rank]
    return shrunk


@host_wrapper(_expand_call)
def lora_expand_reference(call: _Expand) -> None:
    """Plain-torch specification of :func:`lora_expand` (same signature; loops over segments and slices)."""
    out, shrunk, lora_b = call.out, call.shrunk, call.lora_b
    rank = lora_b.shape[2]
    for toks, slot in call.mapping.segments():
        off = 0
        for s, size in enumerate(call.output_slices):
            b_s = lora_b[slot, off : off + size].float()  # [size, rank]
            delta = shrunk[toks, s * rank : (s + 1) * rank] @ b_s.T  # [seg_len, size]
            out[toks, off : off + size] = (out[toks, off : off + size].float() + delta).to(out.dtype)
            off += size


def lora_segments(token_slots: torch.Tensor, max_loras: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group a step's tokens by adapter slot: token_slots [num_tokens] int (-1: base model) -> mapping.

    Returns int32 tensors on token_slots' device: ``sorted_token_ids`` [num_tokens] (tokens of each slot in
    their original order, slots increasing, base tokens trailing in no segment), ``segment_starts``
    [max_loras + 1] and ``segment_slots`` [max_loras] (used slots in increasing order, then unused segments
    with slot -1 and zero length). Validating the slot range reads token_slots on the host.
    """
    if token_slots.dim() != 1 or token_slots.is_floating_point() or token_slots.is_complex():
        raise ValueError(
            f"token_slots must be a 1-D integer tensor, got {token_slots.dtype} {tuple(token_slots.shape)}"
        )
    if max_loras < 1:
        raise ValueError(f"max_loras must be positive, got {max_loras}")
    slots = token_slots.long()
    if slots.numel() and (slots.min() < -1 or slots.max() >= max_loras):
        raise ValueError(f"token_slots must lie in [-1, {max_loras}), got values in [{slots.min()}, {slots.max()}]")
    # Base tokens sort after every slot; a stable sort keeps each slot's tokens in their original order.
    sort_key = torch.where(slots < 0, max_loras, slots)
    sorted_token_ids = torch.sort(sort_key, stable=True).indices.to(torch.int32)
    counts = torch.bincount(slots[slots >= 0], minlength=max_loras)  # [max_loras] tokens per slot
    # Used slots first, then unused ones (empty, slot -1 segments); the stable sort keeps slots increasing.
    seg_order = torch.sort((counts == 0).to(torch.int8), stable=True).indices
    seg_counts = counts[seg_order]
    segment_slots = torch.where(seg_counts > 0, seg_order, -1).to(torch.int32)
    segment_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=slots.device)
    segment_starts[1:] = torch.cumsum(seg_counts, 0)
    return sorted_token_ids, segment_starts, segment_slots
