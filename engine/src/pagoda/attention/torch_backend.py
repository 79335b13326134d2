"""Paged attention in PyTorch and the native CPU kernel: the backend of CPU runs, and the plain-PyTorch reference
the Triton kernels are tested against. The cache layout and the fp8 cache format are those of
:mod:`pagoda.attention.protocol`."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from pagoda.attention.protocol import (
    AttentionLayerSpec,
    AttentionMetadata,
    check_sinks,
    dequantize_kv,
    is_fp8,
    quantize_kv,
)
from pagoda.cpu import cpu_ops, use_fused_ops


@functools.cache
def _native_attention_built() -> bool:
    return cpu_ops() and bool(torch.ops.pagoda_cpu.paged_attention_supported())


def native_attention_applies(q: torch.Tensor, spec: AttentionLayerSpec) -> bool:
    """Whether the native CPU kernel (``pagoda/cpu/paged_attention.cpp``) serves this layer.

    16-bit activations only, like the other native ops: float32 runs keep SDPA, which tests hold
    bit-exact to transformers. The kernel has neither soft-capping nor sinks: such layers take the plain path.
    """
    return (
        spec.plain_softmax
        and spec.head_dim % 16 == 0
        and spec.head_dim <= 256
        and use_fused_ops(q)
        and _native_attention_built()
    )


class TorchAttentionBackend:
    """Paged attention on the CPU (and the plain-PyTorch reference for the Triton kernels).

    bf16/fp16 layers on an AVX-512 CPU run one native kernel over the whole varlen batch that
    reads K/V blocks in place through the block tables. Otherwise (float32, or no native build)
    decode requests (one query token) are batched into one padded SDPA call over their gathered
    contexts, and each prefill chunk runs its own SDPA with a causal mask offset by the cached
    prefix. All of this step's K/V are written before any request attends, so a request may
    read blocks another request of the same step is filling (prefix-cache hits in one step).
    Layers with a logit soft cap or sinks, which neither SDPA nor the native kernel computes, take
    the same gathers and masks into an explicit float32 softmax (:func:`_plain_attention`).
    """

    name = "torch"

    def __init__(self) -> None:
        # Steps with prompt rows on bf16/fp16: 'native' or 'sdpa' (oneDNN, AMX where present); chosen by timing at
        # start-up (pagoda.attention.choice). Pure-decode steps always take the native kernel.
        self.prefill_kernel = "native"

    def prepare(self, meta: AttentionMetadata) -> None:
        # Which path a layer takes depends on its dtype; each path builds its own state on first use.
        meta.backend_state["prepared_by"] = self.name

    def _prepare_native(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        state = meta.backend_state
        if "native_lens" not in state:
            state["native_lens"] = (
                torch.tensor(meta.query_start_loc, dtype=torch.int64),
                torch.tensor(meta.seq_lens, dtype=torch.int64),
            )
        return state["native_lens"]

    def _prepare_sdpa(self, meta: AttentionMetadata) -> None:
        bs = meta.block_size
        device = meta.block_tables.device
        decode_rows: list[int] = []
        prefill_rows: list[int] = []
        for i in range(meta.num_reqs):
            (decode_rows if meta.query_len(i) == 1 else prefill_rows).append(i)
        state = meta.backend_state
        state["prefill_rows"] = prefill_rows
        state["prefill_index"] = {}
        for i in prefill_rows:
            if meta.query_len(i) != meta.seq_lens[i]:  # a cached prefix must be gathered
                state["prefill_index"][i] = _context_slots(meta.block_tables[i], meta.seq_lens[i], bs)
        state["decode_rows"] = decode_rows
        state["masks"] = {}  # built on first use by a layer, then shared by all layers
        if decode_rows:
            lens = torch.tensor([meta.seq_lens[i] for i in decode_rows], dtype=torch.int64, device=device)
            max_len = int(lens.max())
            pos = torch.arange(max_len, dtype=torch.int64, device=device)
            tables = meta.block_tables[decode_rows]  # [num_decodes, max_blocks]
            # index: [num_decodes, max_len] slot of each context position (padding -> slot 0)
            index = tables.gather(1, (pos // bs).expand(len(decode_rows), -1)) * bs + pos % bs
            valid = pos.unsqueeze(0) < lens.unsqueeze(1)
            state["decode_index"] = torch.where(valid, index, 0)
            state["decode_valid"] = valid
            # every row sees its whole gathered context: no mask at all (SDPA's fastest path)
            state["decode_unmasked"] = bool(valid.all()) if device.type == "cpu" else False
            state["decode_lens"] = lens
            state["decode_query_index"] = torch.tensor(
                [meta.query_start_loc[i] for i in decode_rows], dtype=torch.int64, device=device
            )

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        spec: AttentionLayerSpec,
        sinks: Optional[Tensor] = None,
    ) -> Tensor:
        """:meth:`AttentionBackend.forward <pagoda.attention.protocol.AttentionBackend.forward>`."""
        check_sinks(spec, sinks)
        if native_attention_applies(q, spec) and not (self.prefill_kernel == "sdpa" and _has_prompt_rows(meta)):
            query_start_loc, seq_lens = self._prepare_native(meta)
            return torch.ops.pagoda_cpu.paged_attention(  # writes this step's K/V into the caches first
                q,
                kv_cache[0],
                kv_cache[1],
                meta.block_tables,
                query_start_loc,
                seq_lens,
                spec.scale,
                spec.sliding_window or 0,
                k,
                v,
                meta.slot_mapping,
                spec.k_scale,
                spec.v_scale,
            )
        key_cache = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_dim)
        value_cache = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_dim)
        k, v = _write_kv(key_cache, value_cache, k, v, meta.slot_mapping, spec)
        state = meta.backend_state
        if "prefill_rows" not in state:
            self._prepare_sdpa(meta)
        if not state["prefill_rows"]:  # pure decode: rows are the decodes in order, no scatter needed
            return self._decode(q, key_cache, value_cache, state, spec, sinks)
        out = torch.empty_like(q)
        for i in state["prefill_rows"]:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            index = state["prefill_index"].get(i)
            if index is None:  # whole context is this chunk: use k/v directly
                ctx_k, ctx_v = k[start:end], v[start:end]
            else:
                ctx_k, ctx_v = (
                    _gather(key_cache, index, spec.k_scale, q.dtype),
                    _gather(value_cache, index, spec.v_scale, q.dtype),
                )
            # SDPA takes None for a causal square; the plain softmax needs the mask itself (window 0: causal only)
            window = spec.sliding_window if spec.plain_softmax else spec.sliding_window or 0
            key = (i, window)
            if key not in state["masks"]:
                state["masks"][key] = _prefill_mask(end - start, meta.seq_lens[i], window, q.device)
            q_i, ctx_k, ctx_v, mask = q[start:end][None], ctx_k[None], ctx_v[None], state["masks"][key]
            if spec.plain_softmax:
                out[start:end] = _sdpa(q_i, ctx_k, ctx_v, mask, spec)[0]
            else:
                out[start:end] = _plain_attention(q_i, ctx_k, ctx_v, mask[None], spec, sinks)[0]
        if state["decode_rows"]:
            rows = state["decode_query_index"]
            out[rows] = self._decode(q[rows], key_cache, value_cache, state, spec, sinks)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        state: dict[str, Any],
        spec: AttentionLayerSpec,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        index, valid = state["decode_index"], state["decode_valid"]
        ctx_k = _gather(key_cache, index, spec.k_scale, q.dtype)  # [num_decodes, max_len, kv_heads, dim]
        ctx_v = _gather(value_cache, index, spec.v_scale, q.dtype)
        if spec.sliding_window is None and state["decode_unmasked"] and spec.plain_softmax:
            # Each KV head's query group becomes that head's "query rows" (SDPA's enable_gqa path is
            # several times slower on the CPU): q -> [num_decodes, kv_heads, group, head_dim].
            num_decodes, group = q.shape[0], spec.num_heads // spec.num_kv_heads
            out = F.scaled_dot_product_attention(
                q.view(num_decodes, spec.num_kv_heads, group, spec.head_dim),
                ctx_k.transpose(1, 2),
                ctx_v.transpose(1, 2),
                scale=spec.scale,
            )
            return out.reshape(num_decodes, spec.num_heads, spec.head_dim)
        mask = valid
        if spec.sliding_window is not None:
            mask = state["masks"].get(spec.sliding_window)
            if mask is None:
                pos = torch.arange(valid.shape[1], device=valid.device)
                first = (state["decode_lens"] - spec.sliding_window).unsqueeze(1)
                mask = valid & (pos.unsqueeze(0) >= first)
                state["masks"][spec.sliding_window] = mask
        if not spec.plain_softmax:
            return _plain_attention(q.unsqueeze(1), ctx_k, ctx_v, mask.unsqueeze(1), spec, sinks)[:, 0]
        return _sdpa(q.unsqueeze(1), ctx_k, ctx_v, mask[:, None, None, :], spec)[:, 0]


def _has_prompt_rows(meta: AttentionMetadata) -> bool:
    """Whether any request of the step has more than one query token (a prompt chunk), once per step."""
    state = meta.backend_state
    if "has_prompt_rows" not in state:
        state["has_prompt_rows"] = meta.num_tokens > meta.num_reqs
    return state["has_prompt_rows"]


def _write_kv(
    key_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    value_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
    spec: AttentionLayerSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write this step's K/V at their slots; returns them as the cache now holds them (an fp8 cache's codes widened
    back to k's dtype), so a chunk that attends to itself sees what every later step will read."""
    if not is_fp8(key_cache.dtype):
        key_cache.index_copy_(0, slot_mapping, k)
        value_cache.index_copy_(0, slot_mapping, v)
        return k, v
    k_codes = quantize_kv(k, spec.k_scale, key_cache.dtype)
    v_codes = quantize_kv(v, spec.v_scale, value_cache.dtype)
    # index_copy_ has no fp8 kernels: copy the bytes
    key_cache.view(torch.uint8).index_copy_(0, slot_mapping, k_codes.view(torch.uint8))
    value_cache.view(torch.uint8).index_copy_(0, slot_mapping, v_codes.view(torch.uint8))
    return dequantize_kv(k_codes, spec.k_scale, k.dtype), dequantize_kv(v_codes, spec.v_scale, v.dtype)


def _gather(
    cache: torch.Tensor, index: torch.Tensor, scale: float = 1.0, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """cache[index] for cache [num_slots, kv_heads, head_dim] and any index shape, an fp8 cache's rows widened to
    ``dtype`` times ``scale``; index_select on the flattened index is twice as fast as advanced indexing on the CPU
    (measured: 142 vs 294 us)."""
    shape = (*index.shape, *cache.shape[1:])
    if is_fp8(cache.dtype):
        codes = cache.view(torch.uint8).index_select(0, index.reshape(-1)).view(cache.dtype)
        return dequantize_kv(codes, scale, dtype or torch.float32).view(shape)
    return cache.index_select(0, index.reshape(-1)).view(shape)


def _context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len, dtype=torch.int64, device=block_table.device)
    return block_table[pos // block_size] * block_size + pos % block_size


def _prefill_mask(
    q_len: int, seq_len: int, sliding_window: Optional[int], device: torch.device
) -> Optional[torch.Tensor]:
    """Boolean [q_len, seq_len] mask (True = attend), or None for a plain causal square (unless sliding_window is
    0: then always the mask, without a window)."""
    if q_len == seq_len and sliding_window is None:
        return None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _sdpa(
    q: torch.Tensor,  # [batch, q_len, num_heads, head_dim]
    k: torch.Tensor,  # [batch, kv_len, num_kv_heads, head_dim]
    v: torch.Tensor,
    mask: Optional[torch.Tensor],  # [..., q_len, kv_len] bool, or None for causal
    spec: AttentionLayerSpec,
) -> torch.Tensor:  # [batch, q_len, num_heads, head_dim]
    group = spec.num_heads // spec.num_kv_heads
    if group == 1 or mask is None:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=spec.scale,
            enable_gqa=group > 1,
        )
        return out.transpose(1, 2)
    # GQA with a mask: SDPA's CPU kernels take a slow path for enable_gqa + mask, and repeating
    # K/V doubles the bytes read. Fold each KV head's query group into the query axis instead:
    # q -> [batch, kv_heads, q_len * group, head_dim], every row keeping its own mask row.
    batch, q_len = q.shape[0], q.shape[1]
    q = q.view(batch, q_len, spec.num_kv_heads, group, spec.head_dim).permute(0, 2, 1, 3, 4)
    q = q.reshape(batch, spec.num_kv_heads, q_len * group, spec.head_dim)
    mask = mask.repeat_interleave(group, dim=-2) if mask.shape[-2] == q_len and q_len > 1 else mask
    out = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=spec.scale
    )  # [batch, kv_heads, q_len * group, head_dim]
    out = out.view(batch, spec.num_kv_heads, q_len, group, spec.head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(batch, q_len, spec.num_heads, spec.head_dim)


# Scores of one _plain_attention pass are at most this many float32 elements (64 MiB); longer chunks go in parts.
_PLAIN_SCORES = 1 << 24


def _plain_attention(
    q: torch.Tensor,  # [batch, q_len, num_heads, head_dim]
    k: torch.Tensor,  # [batch, kv_len, num_kv_heads, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor,  # [batch or 1, q_len, kv_len] bool, True = attend
    spec: AttentionLayerSpec,
    sinks: Optional[torch.Tensor],  # [num_heads], or None
) -> torch.Tensor:  # [batch, q_len, num_heads, head_dim]
    """:func:`_plain_rows` over slices of the batch, so that a decode batch (q_len 1) over long contexts also keeps
    its scores and its float32 copy of K/V within about ``_PLAIN_SCORES`` elements per pass."""
    batch = q.shape[0]
    rows = max(1, _PLAIN_SCORES // (spec.num_heads * k.shape[1] * q.shape[1]))
    if batch <= rows:
        return _plain_rows(q, k, v, mask, spec, sinks)
    parts = []
    for lo in range(0, batch, rows):
        part_mask = mask[lo : lo + rows] if mask.shape[0] > 1 else mask
        parts.append(_plain_rows(q[lo : lo + rows], k[lo : lo + rows], v[lo : lo + rows], part_mask, spec, sinks))
    return torch.cat(parts)


def _plain_rows(
    q: torch.Tensor,  # [batch, q_len, num_heads, head_dim]
    k: torch.Tensor,  # [batch, kv_len, num_kv_heads, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor,  # [batch or 1, q_len, kv_len] bool, True = attend
    spec: AttentionLayerSpec,
    sinks: Optional[torch.Tensor],  # [num_heads], or None
) -> torch.Tensor:  # [batch, q_len, num_heads, head_dim]
    """Masked attention with an explicit float32 softmax: scores ``scale * q.k``, soft-capped to
    ``cap * tanh(scores / cap)`` when the layer has a cap, masked, then softmax over the keys plus, with sinks, one
    extra column per head holding its sink logit (its probability is dropped). Every row must see a key or a sink."""
    batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
    kv_heads, group, head_dim = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    keys, values = k.float(), v.float()
    sink_col = None if sinks is None else sinks.float().view(1, kv_heads, group, 1, 1)
    out = torch.empty_like(q)
    step = max(1, _PLAIN_SCORES // (batch * spec.num_heads * kv_len))
    for lo in range(0, q_len, step):
        hi = min(q_len, lo + step)
        # query head h = kv_head * group + g reads KV head kv_head
        q_part = q[:, lo:hi].float().view(batch, hi - lo, kv_heads, group, head_dim)
        scores = torch.einsum("bqkgd,blkd->bkgql", q_part, keys) * spec.scale  # [batch, kv_heads, group, q, kv_len]
        if spec.logits_soft_cap is not None:
            scores = torch.tanh(scores / spec.logits_soft_cap) * spec.logits_soft_cap
        scores = scores.masked_fill(~mask[:, None, None, lo:hi], float("-inf"))
        if sink_col is not None:
            scores = torch.cat([scores, sink_col.expand(batch, -1, -1, hi - lo, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :kv_len]
        part = torch.einsum("bkgql,blkd->bqkgd", probs, values)
        out[:, lo:hi] = part.reshape(batch, hi - lo, spec.num_heads, head_dim).to(q.dtype)
    return out
