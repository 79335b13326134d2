"""Fused mixture-of-experts: token sorting by expert and two grouped GEMMs as Triton kernels, and the plain-torch
reference (the specification).

``out[t] = sum_j w[t, j] * (act(x[t] @ w13[e]^T + b13[e]) @ w2[e]^T + b2[e])`` with ``e = topk_ids[t, j]``,
``w = topk_weights``. ``w13[e]`` is ``[gate (I rows) | up (I rows)]``; ``act`` is ``silu(gate) * up`` ("silu") or
gpt-oss's clamped SwiGLU ("swiglu_oai": gate clamped above at ``limit``, up to ``[-limit, limit]``,
``(up + 1) * gate * sigmoid(alpha * gate)``).

Rounding (kernel and reference alike): products accumulate in float32; the gate/up projection (with its bias) is
rounded to the activation dtype, as an unfused ``Linear`` would; the activation is computed in float32 from those
values and rounded once ("silu" rounds ``silu(gate)`` first, as ``F.silu(gate) * up`` does); the down projection,
its bias and the routing weight stay in float32, the k weighted rows of a token are summed in float32 and the sum is
rounded once to the activation dtype.

The GPU path:

1. :func:`moe_align_block_size` sorts the ``T * k`` (token, slot) pairs by expert and pads each expert's run to a
   multiple of ``BLOCK_M`` rows, so every block of rows belongs to one expert (``block_expert``; -1 past the end).
   It is plain torch with shapes fixed by ``T``, ``k``, ``E`` alone (an upper bound on the padded length), so it
   never syncs with the device and can be captured in a CUDA graph.
2. ``_gate_up_kernel``: per (block, column tile of I), the gate and up tiles of that expert are multiplied in two
   float32 accumulators and the activation is applied in the epilogue (no ``[T * k, 2I]`` intermediate); the
   result goes to the block's rows of a ``[padded, I]`` cache, contiguous for the next GEMM.
3. ``_down_kernel``: per (block, column tile of H), the cache rows times ``w2[e]^T``, plus the bias, times the
   pair's routing weight, into a ``[T * k, H]`` float32 buffer at the pair's row.
4. The k rows of each token are summed in float32 (in torch) and rounded to the activation dtype.

Memory per call (at most :data:`CHUNK_TOKENS` tokens at a time): the ``[T * k, H]`` float32 buffer and the
``[T * k + min(E, T * k) * (BLOCK_M - 1), I]`` activation cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from pagoda_kernels.host import dot_precision, host_wrapper, unit_last_stride

ACTIVATIONS = ("silu", "swiglu_oai")
CHUNK_TOKENS = 2048  # tokens per launch pair: bounds the float32 [tokens * k, H] buffer (128 MiB at k=8, H=2048)
_SILU, _SWIGLU_OAI = tl.constexpr(0), tl.constexpr(1)


@dataclass(frozen=True, slots=True)
class MoeTiles:
    """Tile sizes of both grouped GEMMs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def moe_tiles(device: torch.device, num_pairs: int, num_experts: int) -> MoeTiles:
    """Tiles from the shapes alone (no autotuning, which a CUDA-graph capture cannot contain): the row block follows
    the average rows per expert, since each expert's run is padded to a whole block (decode: 16-row blocks)."""
    if device.type != "cuda":
        return MoeTiles(16, 32, 32, num_warps=1, num_stages=1)  # the interpreter: small tiles, several per test shape
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return MoeTiles(16, 64, 128, num_warps=4, num_stages=4)
    if per_expert <= 48:
        return MoeTiles(32, 64, 64, num_warps=4, num_stages=4)
    return MoeTiles(64, 128, 64, num_warps=8, num_stages=3)


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    if UPCAST_DOT:  # the interpreter multiplies 16-bit tiles as their raw bits: use exact float32 copies
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    return acc + tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _round(x, out_dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """float32 ``x`` rounded to ``out_dtype``. The interpreter truncates float32 -> bfloat16 (a GPU rounds to nearest
    even): with ``RNE_BF16`` the rounding is done on the bits first, so interpreted runs round as a GPU does."""
    if RNE_BF16 and out_dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # to nearest, ties to even, in the top 16 bits
        x = bits.to(tl.float32, bitcast=True)
    return x.to(out_dtype)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H], unit last stride
    w_ptr,  # [E, 2I, H]: any strides
    b_ptr,  # [E, 2I] (HAS_BIAS)
    sorted_ptr,  # [num_blocks * BLOCK_M] int32 pair ids (num_pairs: padding)
    block_expert_ptr,  # [num_blocks] int32, -1: no rows
    act_ptr,  # [num_blocks * BLOCK_M, I] activation cache
    num_pairs,
    top_k,
    inter,
    hidden,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    X: tl.constexpr = x_ptr.dtype.element_ty
    slots = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of the cache
    pairs = tl.load(sorted_ptr + slots).to(tl.int64)
    valid = pairs < num_pairs
    tokens = pairs // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of I
    col_valid = cols < inter
    x_rows = x_ptr + tokens[:, None] * stride_xm  # [BLOCK_M, 1]
    w_gate = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < hidden
        x = tl.load(x_rows + offs_k[None, :], mask=valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & col_valid[None, :]
        g = tl.load(w_gate + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        u = tl.load(w_up + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc_gate = _dot(x, g, acc_gate, DOT_PRECISION, UPCAST_DOT)
        acc_up = _dot(x, u, acc_up, DOT_PRECISION, UPCAST_DOT)
    if HAS_BIAS:
        bias = b_ptr + expert * stride_be + cols
        acc_gate += tl.load(bias, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias + inter, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    gate = _round(acc_gate, X, RNE_BF16).to(tl.float32)  # the projection's output in the activation dtype
    up = _round(acc_up, X, RNE_BF16).to(tl.float32)
    if ACTIVATION == _SILU:
        act = _round(gate / (1.0 + tl.exp(-gate)), X, RNE_BF16).to(tl.float32) * up  # silu rounded first, as F.silu
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    mask = valid[:, None] & col_valid[None, :]
    tl.store(act_ptr + slots[:, None] * inter + cols[None, :], _round(act, X, RNE_BF16), mask=mask)


@triton.jit
def _down_kernel(
    act_ptr,  # [num_blocks * BLOCK_M, I] activation cache
    w_ptr,  # [E, H, I]: any strides
    b_ptr,  # [E, H] (HAS_BIAS)
    sorted_ptr,
    block_expert_ptr,
    weights_ptr,  # [num_pairs] float32 routing weights
    out_ptr,  # [num_pairs, H] float32
    num_pairs,
    inter,
    hidden,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    slots = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + slots).to(tl.int64)
    valid = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of H
    col_valid = cols < hidden
    a_rows = act_ptr + slots[:, None] * inter  # [BLOCK_M, 1]
    w_cols = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < inter
        # padding rows were never written: masked to 0 (each output row depends on its own input row only)
        a = tl.load(a_rows + offs_k[None, :], mask=valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_cols + offs_k[:, None] * stride_wk, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        acc = _dot(a, w, acc, DOT_PRECISION, UPCAST_DOT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    mask = valid[:, None] & col_valid[None, :]
    tl.store(out_ptr + pairs[:, None] * hidden + cols[None, :], acc, mask=mask)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [num_blocks * block_m] int32, block_expert [num_blocks] int32) for ``topk_ids [T, k]``.

    ``sorted_ids`` lists the flat pair ids ``t * k + j`` grouped by expert (in pair order within an expert), each
    expert's run padded with ``T * k`` to a multiple of ``block_m``; ``block_expert[b]`` is the expert of rows
    ``b * block_m ..``, -1 for blocks past the last run. ``num_blocks`` covers the worst case (every non-empty expert
    padded by ``block_m - 1``), so no shape depends on the ids' values and nothing syncs with the device.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = padded_start[expert_of] + torch.arange(n, device=device) - run_start[expert_of]
    num_blocks = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)  # the run holding row `start`
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@dataclass(frozen=True, slots=True)
class _MoeCall:
    hidden: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    b13: Optional[torch.Tensor]
    b2: Optional[torch.Tensor]
    activation: str
    alpha: float
    limit: float

    @property
    def inter(self) -> int:
        return self.w2.shape[2]


def _moe_call(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> _MoeCall:
    """Checks shapes, dtypes and devices (never values: that would sync with the device)."""
    if hidden.dim() != 2 or hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"hidden must be a [T, H] float16/bfloat16/float32 tensor, got {hidden.dtype} {hidden.shape}")
    (t, h), e = hidden.shape, w13.shape[0]
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2 != 0:
        raise ValueError(f"w13 must be [E, 2 * I, {h}], got {tuple(w13.shape)}")
    inter = w13.shape[1] // 2
    if w2.shape != (e, h, inter):
        raise ValueError(f"w2 must be [{e}, {h}, {inter}], got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be an integer [{t}, k] tensor, got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32 {tuple(topk_ids.shape)}, got {topk_weights.dtype}")
    for name, bias, shape in (("b13", b13, (e, 2 * inter)), ("b2", b2, (e, h))):
        if bias is not None and (bias.shape != shape or not bias.is_floating_point()):
            raise ValueError(f"{name} must be a float {shape} tensor, got {bias.dtype} {tuple(bias.shape)}")
    tensors = [x for x in (w13, w2, topk_weights, topk_ids, b13, b2) if x is not None]
    if any(x.device != hidden.device for x in tensors) or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError("hidden, the weights, biases and routing must share hidden's device; weights its dtype")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return _MoeCall(hidden, w13, w2, topk_weights, topk_ids, b13, b2, activation, swiglu_alpha, swiglu_limit)


def _launch(call: _MoeCall, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Both GEMMs for one chunk of tokens: -> [T_chunk * k, H] float32 weighted expert outputs."""
    (t, h), (e, _, inter), top_k = hidden.shape, call.w2.shape, ids.shape[1]
    n, device = t * top_k, hidden.device
    tiles = moe_tiles(device, n, e)
    sorted_ids, block_expert = moe_align_block_size(ids, e, tiles.block_m)
    num_blocks = block_expert.shape[0]
    act = torch.empty((num_blocks * tiles.block_m, inter), dtype=hidden.dtype, device=device)
    out = torch.empty((n, h), dtype=torch.float32, device=device)
    interpreted = device.type != "cuda"
    dot = {"DOT_PRECISION": "ieee" if interpreted else dot_precision(hidden.dtype), "UPCAST_DOT": interpreted}
    common = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **dot)
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    w13, w2, b13, b2 = call.w13, call.w2, call.b13, call.b2
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles.block_n))](
        hidden,
        w13,
        b13 if b13 is not None else w13,  # placeholders are never read
        sorted_ids,
        block_expert,
        act,
        n,
        top_k,
        inter,
        h,
        hidden.stride(0),
        *w13.stride(),
        b13.stride(0) if b13 is not None else 0,
        call.alpha,
        call.limit,
        ACTIVATION=ACTIVATIONS.index(call.activation),
        HAS_BIAS=b13 is not None,
        RNE_BF16=interpreted,
        **common,
        **launch,
    )
    _down_kernel[(num_blocks, triton.cdiv(h, tiles.block_n))](
        act,
        w2,
        b2 if b2 is not None else w2,
        sorted_ids,
        block_expert,
        weights,
        out,
        n,
        inter,
        h,
        *w2.stride(),
        b2.stride(0) if b2 is not None else 0,
        HAS_BIAS=b2 is not None,
        **common,
        **launch,
    )
    return out


@host_wrapper(_moe_call)
def fused_moe(call: _MoeCall) -> torch.Tensor:
    """The mixture-of-experts layer's experts as two grouped Triton GEMMs -> [T, H] in hidden's dtype (see the
    module docstring). Weights may have any strides (e.g. per-expert views); tokens run :data:`CHUNK_TOKENS` at a
    time. Never syncs with the device."""
    hidden = unit_last_stride(call.hidden)
    t, h = hidden.shape
    top_k = call.topk_ids.shape[1]
    out = torch.empty((t, h), dtype=hidden.dtype, device=hidden.device)
    for t0 in range(0, t, CHUNK_TOKENS):
        t1 = min(t, t0 + CHUNK_TOKENS)
        weights = call.topk_weights[t0:t1].reshape(-1).contiguous()
        pairs = _launch(call, hidden[t0:t1], call.topk_ids[t0:t1], weights)  # [(t1 - t0) * k, H] float32
        out[t0:t1] = pairs.view(t1 - t0, top_k, h).sum(dim=1).to(hidden.dtype)
    return out


def _activation(gate: torch.Tensor, up: torch.Tensor, call: _MoeCall) -> torch.Tensor:
    """The activation of rounded gate/up rows, in float32, rounded to their dtype (see the module docstring)."""
    dtype = gate.dtype
    if call.activation == "silu":
        return (torch.nn.functional.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    g = gate.float().clamp(max=call.limit)
    u = up.float().clamp(-call.limit, call.limit)
    return ((u + 1) * g * torch.sigmoid(call.alpha * g)).to(dtype)


@host_wrapper(_moe_call)
def fused_moe_reference(call: _MoeCall) -> torch.Tensor:
    """Plain-torch specification of :func:`fused_moe`: token by token, slot by slot, float32 products and sums."""
    x, inter = call.hidden, call.inter
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(call.topk_ids.shape[1]):
            e = int(call.topk_ids[t, j])
            gate_up = call.w13[e].float() @ x[t].float()  # [2I]
            if call.b13 is not None:
                gate_up = gate_up + call.b13[e].float()
            gate_up = gate_up.to(x.dtype)
            act = _activation(gate_up[:inter], gate_up[inter:], call)  # [I]
            y = call.w2[e].float() @ act.float()  # [H]
            if call.b2 is not None:
                y = y + call.b2[e].float()
            acc += call.topk_weights[t, j] * y
        out[t] = acc.to(x.dtype)
    return out
