"""Logit soft-capping (Gemma 2) and attention sinks (gpt-oss) in the paged decode and extend kernels.

The plain-torch references are first held to a dense attention written the way transformers' eager attention of
gemma2 (``cap * tanh(scores / cap)`` after scaling, before the mask) and gpt_oss (a sink logit per head
concatenated as a last softmax column, then dropped) compute it. The Triton kernels are then held to the references
with each feature alone and combined with sliding windows, GQA, split contexts, a cached prefix, decode rows in a
prefill batch and fp8 caches. Unused cache slots and outputs start as NaN, so a stray read or a skipped row shows.
Small shapes: on CPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from pagoda_kernels.decode_attention import paged_decode_attention, paged_decode_attention_reference
from pagoda_kernels.extend_attention import paged_extend_attention, paged_extend_attention_reference
from pagoda_kernels.fp8_codes import quantize_fp8_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM, BLOCK_SIZE = 16, 4
TOL = dict(atol=2e-5, rtol=1e-4)
SINKS = [0.7, -1.0, 2.5, 0.0, 1.2, -0.3, 4.0, 0.5]  # head 6's sink outweighs most of its keys


def paged(seq_lens: list[int], num_kv_heads: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Random float32 contexts (x2, so soft caps bite) in shuffled blocks of a NaN-filled cache: (kv_cache [2, blocks,
    BLOCK_SIZE, kv_heads, HEAD_DIM], block_tables int32 [reqs, max_blocks], dense (k, v) per request)."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(per_req) + 2
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in per_req]
    cache = torch.full((2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM), float("nan"))
    dense = []
    for table, n in zip(tables, seq_lens):
        kv = torch.randn(2, n, num_kv_heads, HEAD_DIM, generator=gen) * 2
        pos = torch.arange(n)
        cache[:, torch.tensor(table, dtype=torch.int64)[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = kv
        dense.append((kv[0], kv[1]))
    width = max(per_req) + 1
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return cache.to(DEVICE), block_tables.to(DEVICE), dense


def dense_attention(q, k, v, q_positions, scale, soft_cap=None, window=None, sinks=None) -> torch.Tensor:
    """transformers-style eager attention of queries q [n, heads, dim] at q_positions over keys 0..len(k)-1."""
    group = q.shape[1] // k.shape[1]
    query = q.float().transpose(0, 1)
    key = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    value = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    weights = torch.matmul(query, key.transpose(1, 2)) * scale
    if soft_cap is not None:
        weights = torch.tanh(weights / soft_cap) * soft_cap
    k_pos = torch.arange(k.shape[0])
    visible = k_pos[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_positions[:, None] - window
    weights = weights + torch.zeros(visible.shape).masked_fill(~visible, -math.inf)
    if sinks is not None:
        logits = torch.cat([weights, sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
        weights = F.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    else:
        weights = F.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(0, 1)


def sinks_for(num_heads: int, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(SINKS[:num_heads], dtype=dtype, device=DEVICE)


# ---- decode ---------------------------------------------------------------------------------------------------------

DECODE_LENS = [1, 23, 0, 41]  # one key, partial blocks, a padding row, several tiles


def decode_args(num_heads=8, num_kv_heads=2, lens=DECODE_LENS, seed=0):
    cache, tables, dense = paged(lens, num_kv_heads, seed)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE), dense


@pytest.mark.parametrize("window", [None, 7])
def test_decode_reference_is_transformers_eager_attention(window):
    q, cache, tables, seq_lens, dense = decode_args()
    sinks = sinks_for(8)
    got = paged_decode_attention_reference(
        q, cache, tables, seq_lens, 0.3, sliding_window=window, logits_soft_cap=2.0, sinks=sinks
    ).cpu()
    for i, (k, v) in enumerate(dense):
        if len(k) == 0:
            assert torch.equal(got[i], torch.zeros_like(got[i]))  # padding row
            continue
        want = dense_attention(q[i : i + 1].cpu(), k, v, torch.tensor([len(k) - 1]), 0.3, 2.0, window, sinks.cpu())
        torch.testing.assert_close(got[i], want[0], **TOL)


DECODE_CASES = {
    "soft_cap": dict(logits_soft_cap=1.5),
    "sinks": dict(sinks=True),
    "soft_cap+sinks": dict(logits_soft_cap=3.0, sinks=True),
    "window+sinks": dict(sliding_window=6, sinks=True),
    "window+soft_cap": dict(sliding_window=9, logits_soft_cap=2.0),
}


@pytest.mark.parametrize("num_splits", [1, 3])  # stage 1 alone, and the merge stage
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_kernel_matches_reference(case, num_splits):
    q, cache, tables, seq_lens, _ = decode_args()
    features = dict(DECODE_CASES[case])
    if features.pop("sinks", False):
        features["sinks"] = sinks_for(8)
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(q, cache, tables, seq_lens, 0.3, num_splits=num_splits, out=out, **features)
    want = paged_decode_attention_reference(q, cache, tables, seq_lens, 0.3, **features)
    assert torch.isfinite(got).all()
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # the padding row stays zeros, sinks or not
    torch.testing.assert_close(got, want, **TOL)


def test_decode_with_a_dominant_sink_gives_almost_nothing_and_stays_finite():
    q, cache, tables, seq_lens, _ = decode_args(num_heads=4, num_kv_heads=4)
    sinks = torch.tensor([200.0, -200.0, 0.0, 80.0], device=DEVICE)  # far beyond any score, either way
    for num_splits in (1, 4):
        got = paged_decode_attention(q, cache, tables, seq_lens, 0.25, num_splits=num_splits, sinks=sinks)
        torch.testing.assert_close(got, paged_decode_attention_reference(q, cache, tables, seq_lens, 0.25, sinks=sinks))
        assert got[:, [0, 3]].abs().max() < 1e-20
        torch.testing.assert_close(got[:, 1], paged_decode_attention_reference(q, cache, tables, seq_lens, 0.25)[:, 1])


# ---- extend (chunked prefill, mixed with decodes) --------------------------------------------------------------------

# (cached prefix, chunk): a fresh prompt, a chunk on a prefix, a decode row, a chunk on an unaligned prefix.
EXTEND_REQUESTS = [(0, 11), (13, 6), (20, 1), (5, 9)]


def extend_args(num_heads=4, num_kv_heads=2, seed=0):
    seq_lens = [p + n for p, n in EXTEND_REQUESTS]
    cache, tables, dense = paged(seq_lens, num_kv_heads, seed)
    starts = [0]
    for _, n in EXTEND_REQUESTS:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return (q, cache, tables, loc, lens, max(n for _, n in EXTEND_REQUESTS)), dense


def test_extend_reference_is_transformers_eager_attention():
    args, dense = extend_args()
    sinks = sinks_for(4)
    got = paged_extend_attention_reference(*args, 0.4, sliding_window=8, logits_soft_cap=2.5, sinks=sinks).cpu()
    row = 0
    for (prefix, n), (k, v) in zip(EXTEND_REQUESTS, dense):
        q_pos = torch.arange(prefix, prefix + n)
        want = dense_attention(args[0][row : row + n].cpu(), k, v, q_pos, 0.4, 2.5, 8, sinks.cpu())
        torch.testing.assert_close(got[row : row + n], want, **TOL)
        row += n


EXTEND_CASES = {
    "soft_cap": dict(logits_soft_cap=2.0),
    "sinks": dict(sinks=True),
    "soft_cap+sinks+window": dict(logits_soft_cap=2.0, sinks=True, sliding_window=5),
    "window+sinks": dict(sliding_window=3, sinks=True),
}


@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_extend_kernel_matches_reference(case, heads):
    args, _ = extend_args(*heads)
    features = dict(EXTEND_CASES[case])
    if features.pop("sinks", False):
        features["sinks"] = sinks_for(heads[0])
    out = torch.full_like(args[0], float("nan"))
    got = paged_extend_attention(*args, 0.4, out=out, **features)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, paged_extend_attention_reference(*args, 0.4, **features), **TOL)


# ---- fp8 caches ---------------------------------------------------------------------------------------------------


def fp8_cache(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the e4m3 codes of a cache, the float32 cache of code * scale the kernels must behave as if reading)."""
    codes = torch.stack([quantize_fp8_reference(cache[0], k_scale, torch.float8_e4m3fn),
                         quantize_fp8_reference(cache[1], v_scale, torch.float8_e4m3fn)])  # fmt: skip
    return codes, torch.stack([codes[0].float() * k_scale, codes[1].float() * v_scale])


@pytest.mark.parametrize("sinks", [False, True])
def test_soft_cap_over_an_fp8_cache(sinks):
    k_scale, v_scale = 0.02, 0.01
    extra = dict(logits_soft_cap=2.0, sinks=sinks_for(8) if sinks else None)
    q, cache, tables, seq_lens, _ = decode_args()
    codes, widened = fp8_cache(cache, k_scale, v_scale)
    want = paged_decode_attention_reference(q, widened, tables, seq_lens, 0.3, **extra)
    for num_splits in (1, 2):
        got = paged_decode_attention(
            q, codes, tables, seq_lens, 0.3, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale, **extra
        )
        torch.testing.assert_close(got, want, **TOL)
    (q, cache, *rest), _ = extend_args()
    codes, widened = fp8_cache(cache, k_scale, v_scale)
    extra["sinks"] = sinks_for(4) if sinks else None
    want = paged_extend_attention_reference(q, widened, *rest, 0.4, sliding_window=6, **extra)
    got = paged_extend_attention(q, codes, *rest, 0.4, sliding_window=6, k_scale=k_scale, v_scale=v_scale, **extra)
    torch.testing.assert_close(got, want, **TOL)


def test_half_precision_queries_take_float32_sinks():
    (q, cache, *rest), _ = extend_args()
    q, cache = q.half(), cache.half()
    sinks = sinks_for(4)
    got = paged_extend_attention(q, cache, *rest, 0.4, logits_soft_cap=2.0, sinks=sinks)
    want = paged_extend_attention_reference(q, cache, *rest, 0.4, logits_soft_cap=2.0, sinks=sinks)
    torch.testing.assert_close(got, want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(logits_soft_cap=0.0), "logits_soft_cap"),
        (dict(logits_soft_cap=math.nan), "logits_soft_cap"),
        (dict(sinks=torch.zeros(3)), "sinks"),
    ],
)
def test_bad_soft_cap_or_sinks_are_refused(bad: dict, message: str):
    q, cache, tables, seq_lens, _ = decode_args()
    bad = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in bad.items()}
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(q, cache, tables, seq_lens, 0.3, **bad)
    args, _ = extend_args(num_heads=8)
    with pytest.raises(ValueError, match=message):
        paged_extend_attention(*args, 0.3, **bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_soft_cap_and_sinks_at_realistic_shapes(dtype):
    # gpt-oss-like heads (64 query heads over 8 KV heads, head_dim 64), long contexts split over several runs
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens, block = [700, 1, 2049, 300], 16
    blocks = [-(-n // block) for n in lens]
    cache = torch.randn(2, sum(blocks) + 1, block, 8, 64, device="cuda", generator=gen).to(dtype)
    perm = torch.randperm(sum(blocks), device="cuda", generator=gen) + 1
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    for i, used in enumerate(perm.split(blocks)):
        tables[i, : len(used)] = used
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sinks = torch.randn(64, device="cuda", generator=gen)
    features = dict(logits_soft_cap=30.0, sinks=sinks, sliding_window=128)
    q = torch.randn(len(lens), 64, 64, device="cuda", generator=gen).to(dtype)
    want = paged_decode_attention_reference(q, cache, tables, seq_lens, 0.125, **features)
    got = paged_decode_attention(q, cache, tables, seq_lens, 0.125, num_splits=None, **features)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    query_lens = [256, 1, 512, 300]
    loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(query_lens), 64, 64, device="cuda", generator=gen).to(dtype)
    args = (q, cache, tables, loc, seq_lens, max(query_lens), 0.125)
    torch.testing.assert_close(
        paged_extend_attention(*args, **features),
        paged_extend_attention_reference(*args, **features),
        atol=2e-2,
        rtol=2e-2,
    )
