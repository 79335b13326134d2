"""paged_extend_attention: chunked-prefill attention over the paged KV cache, checked against its reference.

Without a GPU the Triton kernel runs in the interpreter (conftest sets TRITON_INTERPRET=1), so those tests use
few heads and short sequences that still span several query tiles, key tiles and cache blocks. Every cache slot
outside a request's context is NaN, and every output starts as NaN, so reading a slot the request does not own
or leaving a row unwritten shows up as a mismatch. ``gpu`` tests use realistic shapes in bf16 and fp16.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from pagoda_kernels.extend_attention import paged_extend_attention, paged_extend_attention_reference
from pagoda_kernels.fp8_codes import quantize_fp8_reference

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

# (cached prefix, chunk length): a fresh prompt, a chunk on a prefix spanning many blocks whose length is not a
# multiple of any block size, a decode-like single token, and a block-sized chunk on an unaligned prefix.
MIXED_BATCH = [(0, 21), (83, 13), (40, 1), (5, 32)]


@dataclass
class Batch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_reqs, max_blocks]
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    max_query_len: int
    scale: float

    def args(self) -> tuple:
        return (
            self.q,
            self.kv_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.max_query_len,
            self.scale,
        )


def make_batch(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    table_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> Batch:
    """A varlen batch of (prefix_len, query_len) requests whose contexts sit in shuffled cache blocks.

    Block 0 is the padding block of the tables; it and every slot past a request's context hold NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [prefix + q_len for prefix, q_len in requests]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # the padding block and two never-used ones
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_req]

    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    for table, seq_len in zip(tables, seq_lens):
        pos = torch.arange(seq_len)
        blocks = torch.tensor(table)[pos // block_size]
        kv_cache[:, blocks, pos % block_size] = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    max_blocks = max(blocks_per_req)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    query_lens = [q_len for _, q_len in requests]
    query_start_loc = [0]
    for q_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)
    q = torch.randn(query_start_loc[-1], num_heads, head_dim, generator=gen).to(dtype)
    return Batch(
        q=q.to(device),
        kv_cache=kv_cache.to(device),
        block_tables=torch.tensor(padded, dtype=table_dtype, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        scale=head_dim**-0.5,
    )


def kernel_and_reference(batch: Batch, sliding_window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    poisoned = torch.full_like(batch.q, float("nan"))
    got = paged_extend_attention(*batch.args(), sliding_window=sliding_window, out=poisoned)
    want = paged_extend_attention_reference(*batch.args(), sliding_window=sliding_window)
    return got, want


def test_reference_equals_dense_causal_sdpa_for_a_prefix_free_prompt():
    batch = make_batch([(0, 37)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    pos = torch.arange(37)
    blocks = batch.block_tables[0, pos // 16].long()
    keys, values = batch.kv_cache[:, blocks, pos % 16]  # [37, num_kv_heads, head_dim] each
    dense = F.scaled_dot_product_attention(
        batch.q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=batch.scale,
        enable_gqa=True,
    )[0].transpose(0, 1)  # [37, num_heads, head_dim]

    reference = paged_extend_attention_reference(*batch.args())

    torch.testing.assert_close(reference, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_heads, num_kv_heads",
    [
        (torch.float32, 8, 16, 4, 1),  # MQA
        (torch.float32, 64, 32, 4, 2),  # GQA
        (torch.float32, 128, 16, 2, 2),  # MHA
        (torch.float16, 8, 32, 2, 2),
        (torch.float16, 64, 16, 4, 1),
        (torch.float16, 128, 32, 4, 2),
    ],
)
def test_mixed_batch_matches_reference(dtype, head_dim, block_size, num_heads, num_kv_heads):
    batch = make_batch(MIXED_BATCH, num_heads, num_kv_heads, head_dim, block_size, dtype)

    got, want = kernel_and_reference(batch)

    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("requests", [[(0, 40), (0, 3)], [(50, 1), (17, 1), (0, 1)], [(31, 33)]])
def test_prompt_only_decode_only_and_single_request_batches_match_reference(requests):
    batch = make_batch(requests, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)

    got, want = kernel_and_reference(batch)

    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("window", [3, 16, 50, 1000])
def test_sliding_window_matches_reference(window):
    batch = make_batch(MIXED_BATCH, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)

    got, want = kernel_and_reference(batch, sliding_window=window)

    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_window_of_one_returns_each_tokens_own_value():
    batch = make_batch(MIXED_BATCH, num_heads=4, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    own_values = []
    for (prefix, q_len), table in zip(MIXED_BATCH, batch.block_tables):
        pos = torch.arange(prefix, prefix + q_len)
        own_values.append(batch.kv_cache[1, table[pos // 16].long(), pos % 16])  # [q_len, num_kv_heads, head_dim]
    expected = torch.cat(own_values).repeat_interleave(2, dim=1)  # query head h reads kv head h // 2

    got = paged_extend_attention(*batch.args(), sliding_window=1)

    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_strided_q_int64_tables_and_oversized_max_query_len():
    batch = make_batch(
        MIXED_BATCH,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        block_size=32,
        dtype=torch.float16,
        table_dtype=torch.int64,
    )
    # q as the engine sees it: a column slice of a fused qkv projection output.
    num_tokens = batch.q.shape[0]
    qkv = torch.randn(num_tokens, 4 * 64).to(torch.float16)
    qkv[:, : 2 * 64] = batch.q.reshape(num_tokens, -1)
    batch.q = qkv[:, : 2 * 64].view(num_tokens, 2, 64)
    batch.max_query_len += 20  # over-provisioned grid: surplus programs must write nothing

    got, want = kernel_and_reference(batch)

    torch.testing.assert_close(got, want, **TOLERANCES[torch.float16])


def test_fills_and_returns_out_leaving_padding_rows_untouched():
    batch = make_batch([(20, 9), (0, 5)], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    real = batch.q.shape[0]
    batch.q = torch.cat([batch.q, torch.randn(3, 2, 64)])  # CUDA-graph style padding rows past the last request
    out = torch.full_like(batch.q, float("nan"))

    result = paged_extend_attention(*batch.args(), out=out)

    assert result is out
    want = paged_extend_attention_reference(*batch.args())
    torch.testing.assert_close(out[:real], want[:real], **TOLERANCES[torch.float32])
    assert out[real:].isnan().all()


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, kv_head_dim, table_dtype, message",
    [
        (3, 2, 64, torch.int32, "multiple of num_kv_heads"),
        (2, 2, 32, torch.int32, "head_dim mismatch"),
        (2, 2, 64, torch.float32, "int32 or int64"),
    ],
)
def test_rejects_inconsistent_inputs(num_heads, num_kv_heads, kv_head_dim, table_dtype, message):
    q = torch.randn(4, num_heads, 64)
    kv_cache = torch.randn(2, 3, 16, num_kv_heads, kv_head_dim)
    block_tables = torch.tensor([[1]], dtype=table_dtype)
    query_start_loc = torch.tensor([0, 4], dtype=torch.int32)
    seq_lens = torch.tensor([4], dtype=torch.int32)
    for fn in (paged_extend_attention, paged_extend_attention_reference):
        with pytest.raises(ValueError, match=message):
            fn(q, kv_cache, block_tables, query_start_loc, seq_lens, 4, 0.125)


# ---- fp8 caches: codes of K / k_scale and V / v_scale, read back as code * scale --------------------------------
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def with_fp8_cache(batch: Batch, fp8: torch.dtype, q_dtype: torch.dtype) -> tuple[Batch, Batch, float, float]:
    """(the batch over an fp8 cache with q in q_dtype, the same over the float32 dequantized cache, k_scale,
    v_scale). Keys are spread x8 and k_scale puts |k| > 16 past the format's largest value: those saturate. NaN
    slots stay NaN codes."""
    k_scale, v_scale = 16 / torch.finfo(fp8).max, 0.3
    cache = torch.stack(
        [
            quantize_fp8_reference(batch.kv_cache[0].float() * 8, k_scale, fp8),
            quantize_fp8_reference(batch.kv_cache[1].float(), v_scale, fp8),
        ]
    )
    assert (cache[0].float().abs() == torch.finfo(fp8).max).any()
    dequantized = torch.stack([cache[0].float() * k_scale, cache[1].float() * v_scale])
    fp8_batch = Batch(batch.q.to(q_dtype), cache, *batch.args()[2:])
    return fp8_batch, Batch(batch.q.float(), dequantized, *batch.args()[2:]), k_scale, v_scale


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_dtype, window", [(torch.float32, None), (torch.float16, 20)])
def test_fp8_cache_reads_code_times_scale(fp8, q_dtype, window):
    batch, reference_batch, k_scale, v_scale = with_fp8_cache(
        make_batch(MIXED_BATCH, 4, 2, 32, 16, torch.float32, seed=11), fp8, q_dtype
    )
    want = paged_extend_attention_reference(*reference_batch.args(), sliding_window=window).to(q_dtype)
    scales = dict(sliding_window=window, k_scale=k_scale, v_scale=v_scale)
    # the reference reads the fp8 cache through the scales the same way
    torch.testing.assert_close(paged_extend_attention_reference(*batch.args(), **scales), want, **TOLERANCES[q_dtype])
    got = paged_extend_attention(*batch.args(), out=torch.full_like(batch.q, float("nan")), **scales)
    torch.testing.assert_close(got, want, **TOLERANCES[q_dtype])


# Realistic shapes (a GPU is needed): 8 requests, ~2k-token prefixes plus 512-token chunks, mixed with a fresh
# prompt, an unaligned chunk and decode rows.
GPU_BATCH = [(2048, 512), (2000, 512), (0, 512), (1999, 333), (2048, 1), (517, 512), (2100, 1), (1024, 500)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_realistic_batch_matches_reference(dtype, block_size):
    batch = make_batch(GPU_BATCH, 32, 8, 128, block_size, dtype, device="cuda")

    got, want = kernel_and_reference(batch)

    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_sliding_window_matches_reference(dtype):
    batch = make_batch(GPU_BATCH, 16, 4, 128, 16, dtype, device="cuda")

    got, want = kernel_and_reference(batch, sliding_window=1000)

    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(8, 8, 4), (64, 16, 16), (96, 8, 1)])
def test_gpu_small_and_odd_head_dims_match_reference(head_dim, num_heads, num_kv_heads):
    batch = make_batch(GPU_BATCH, num_heads, num_kv_heads, head_dim, 32, torch.float16, device="cuda")

    got, want = kernel_and_reference(batch)

    torch.testing.assert_close(got, want, **TOLERANCES[torch.float16])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
def test_gpu_fp8_cache_realistic_batch_matches_reference(fp8):
    batch, reference_batch, k_scale, v_scale = with_fp8_cache(
        make_batch(GPU_BATCH, 32, 8, 128, 16, torch.float32, device="cuda"), fp8, torch.bfloat16
    )
    got = paged_extend_attention(*batch.args(), k_scale=k_scale, v_scale=v_scale)
    want = paged_extend_attention_reference(*reference_batch.args()).to(torch.bfloat16)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.bfloat16])
