"""paged_decode_attention: one query token per sequence attending over its paged context.

The reference is anchored to dense SDPA first; the Triton kernel is then compared with the reference on
ragged batches whose block tables are shuffled and whose unused cache slots hold NaN (so a read outside a
sequence's context shows up). Runs in Triton's interpreter on CPU (fp32, fp16; its bf16 ``tl.dot`` is
wrong); ``gpu`` tests use realistic shapes in bf16 and fp16.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from pagoda_kernels.decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from pagoda_kernels.fp8_codes import quantize_fp8_reference

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
RAGGED_LENS = [1, 37, 0, 150]  # a single token, a partial block, a padding row, many blocks


@dataclass
class Batch:
    q: torch.Tensor  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks], shuffled physical blocks, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    dense_k: list  # per sequence [seq_len, num_kv_heads, head_dim], what was written through the table
    dense_v: list

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device="cpu", seed=0, table_dtype=None):
    """Random contexts written into a NaN-filled cache at a random permutation of physical blocks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    physical = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    max_blocks = max(blocks_per_seq) + 1  # every row has at least one padding entry
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=table_dtype or torch.int32, device=device)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    dense_k, dense_v = [], []
    for i, n in enumerate(seq_lens):
        owned = [physical.pop() for _ in range(blocks_per_seq[i])]
        tables[i, : len(owned)] = torch.tensor(owned, dtype=tables.dtype, device=device)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        # Token t lives at offset t % block_size of the table's block t // block_size.
        pos = torch.arange(n, device=device)
        blocks = torch.tensor(owned, dtype=torch.int64, device=device)[pos // block_size]
        cache[0, blocks, pos % block_size] = k
        cache[1, blocks, pos % block_size] = v
        dense_k.append(k)
        dense_v.append(v)
    assert torch.isnan(cache).any()  # the poison is really there
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return Batch(q, cache, tables, seq_lens, dense_k, dense_v)


def run_kernel(batch: Batch, **kwargs) -> torch.Tensor:
    """The kernel writing into a NaN-poisoned ``out``, so elements it never writes are caught."""
    out = torch.full_like(batch.q, float("nan"))
    result = paged_decode_attention(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.scale, out=out, **kwargs
    )
    assert result is out
    return result


def reference(batch: Batch, **kwargs) -> torch.Tensor:
    return paged_decode_attention_reference(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.scale, **kwargs
    )


def assert_matches(actual, expected):
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, **TOLERANCE[actual.dtype])


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_reference_equals_dense_sdpa_over_the_context(sliding_window):
    batch = make_batch([5, 77, 33], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    actual = reference(batch, sliding_window=sliding_window)
    for i in range(3):
        first = 0 if sliding_window is None else max(0, len(batch.dense_k[i]) - sliding_window)
        k = batch.dense_k[i][first:].transpose(0, 1)  # [num_kv_heads, n, head_dim]
        v = batch.dense_v[i][first:].transpose(0, 1)
        q = batch.q[i].unsqueeze(1)  # [num_heads, 1, head_dim]: the last position sees its whole window
        dense = F.scaled_dot_product_attention(q, k, v, scale=batch.scale, enable_gqa=True)
        torch.testing.assert_close(actual[i], dense[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(8, 2, 64, 16), (4, 2, 128, 32), (4, 1, 8, 16), (2, 2, 8, 32), (1, 1, 128, 16)],
    ids=["gqa4-d64-b16", "gqa2-d128-b32", "mqa-d8-b16", "mha-d8-b32", "mha1-d128-b16"],
)
def test_matches_reference_on_ragged_shuffled_batches(dtype, num_heads, num_kv_heads, head_dim, block_size):
    batch = make_batch(RAGGED_LENS, num_heads, num_kv_heads, head_dim, block_size, dtype)
    assert_matches(run_kernel(batch), reference(batch))


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_every_split_count_gives_the_same_answer(table_dtype):
    # 7 splits of the shortest contexts leave most runs empty; 3 splits of 150 tokens cut mid-tile.
    batch = make_batch(RAGGED_LENS, 4, 2, 64, 16, torch.float32, seed=1, table_dtype=table_dtype)
    expected = reference(batch)
    results = [run_kernel(batch, num_splits=n) for n in (1, 2, 3, 7)]
    for result in results:
        assert_matches(result, expected)
    torch.testing.assert_close(results[0], results[3], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [1, 20, 64, 1000])
def test_sliding_window_attends_to_the_most_recent_keys(num_splits, sliding_window):
    # Windows of one key, one that starts mid-block, a whole number of blocks, and one wider than any context.
    batch = make_batch([1, 37, 150, 96], 4, 1, 8, 16, torch.float16, seed=2)
    expected = reference(batch, sliding_window=sliding_window)
    assert_matches(run_kernel(batch, sliding_window=sliding_window, num_splits=num_splits), expected)


def test_window_of_one_returns_the_last_value():
    batch = make_batch([1, 20, 35], 2, 2, 8, 16, torch.float32, seed=3)
    actual = run_kernel(batch, sliding_window=1, num_splits=2)
    last_values = torch.stack([v[-1] for v in batch.dense_v])  # [num_seqs, num_kv_heads, head_dim]
    torch.testing.assert_close(actual, last_values, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_rows_are_zeros(num_splits):
    batch = make_batch([0, 19, 0], 4, 2, 16, 16, torch.float32, seed=4)
    actual = run_kernel(batch, num_splits=num_splits)
    assert torch.equal(actual[0], torch.zeros_like(actual[0])) and torch.equal(actual[2], torch.zeros_like(actual[2]))
    assert_matches(actual, reference(batch))


def test_result_does_not_depend_on_the_max_seq_len_hint():
    # max_seq_len only sizes num_splits: an understated bound must not truncate any context.
    batch = make_batch([150, 3], 4, 2, 64, 32, torch.float32, seed=5)
    expected = reference(batch)
    assert_matches(run_kernel(batch, max_seq_len=1), expected)
    assert_matches(run_kernel(batch, max_seq_len=150), expected)


def test_allocates_out_and_reads_strided_queries():
    # q sliced out of a fused qkv projection: its rows are not contiguous.
    batch = make_batch([12, 70], 4, 2, 64, 16, torch.float16, seed=6)
    qkv = torch.cat([batch.q, torch.randn_like(batch.q)], dim=1)
    batch.q = qkv[:, :4]
    assert not batch.q.is_contiguous()
    actual = paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.scale)
    assert actual.dtype == torch.float16 and actual.shape == batch.q.shape
    assert_matches(actual, reference(batch))


def test_default_num_splits_fills_the_gpu_without_tiny_runs():
    cpu = torch.device("cpu")
    assert default_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=4096, device=cpu) == 1  # already full
    small_batch = default_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=4096, device=cpu)
    assert 8 <= small_batch <= 64  # a single sequence is spread over many programs
    assert default_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=100, device=cpu) == 1  # too short to cut
    assert default_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=2048, device=cpu) >= 2


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_heads=3), "multiple of num_kv_heads"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(num_splits=0), "num_splits"),
        (dict(seq_lens=torch.tensor([4.0, 4.0])), "int32/int64"),
    ],
)
def test_rejects_invalid_inputs(change, message):
    q = torch.randn(2, change.pop("num_heads", 4), 16)
    cache = torch.randn(2, 4, 16, 2, 16)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    seq_lens = change.pop("seq_lens", torch.tensor([4, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(q, cache, tables, seq_lens, 0.25, **change)


# ---- fp8 caches: codes of K / k_scale and V / v_scale, read back as code * scale --------------------------------
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_batch(batch: Batch, fp8: torch.dtype, k_scale: float, v_scale: float, q_dtype: torch.dtype) -> Batch:
    """``batch`` with its cache quantized to ``fp8`` (K/V spread x8 so that some codes saturate; NaN poison stays
    NaN codes) and its queries in ``q_dtype``."""
    cache = torch.stack(
        [
            quantize_fp8_reference(batch.kv_cache[0] * 8, k_scale, fp8),
            quantize_fp8_reference(batch.kv_cache[1] * 8, v_scale, fp8),
        ]
    )
    return Batch(batch.q.to(q_dtype), cache, batch.block_tables, batch.seq_lens, batch.dense_k, batch.dense_v)


def dequantized(batch: Batch, k_scale: float, v_scale: float) -> Batch:
    """The same batch over a float32 cache holding code * scale."""
    cache = torch.stack([batch.kv_cache[0].float() * k_scale, batch.kv_cache[1].float() * v_scale])
    return Batch(batch.q.float(), cache, batch.block_tables, batch.seq_lens, batch.dense_k, batch.dense_v)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_fp8_cache_reads_code_times_scale(fp8, q_dtype):
    # Non-1.0 scales, keys above 16 saturate; num_splits 2 (the 150-token context) also runs the merge stage over
    # scaled partials.
    k_scale, v_scale = 16 / torch.finfo(fp8).max, 2.5
    batch = fp8_batch(make_batch(RAGGED_LENS, 8, 2, 64, 16, torch.float32, seed=9), fp8, k_scale, v_scale, q_dtype)
    assert batch.kv_cache.dtype == fp8
    assert (batch.kv_cache[0].float().abs() == torch.finfo(fp8).max).any()  # some keys saturated
    expected = paged_decode_attention_reference(*_args(dequantized(batch, k_scale, v_scale))).to(q_dtype)
    # the reference itself agrees with reading the fp8 cache through the scales
    torch.testing.assert_close(reference(batch, k_scale=k_scale, v_scale=v_scale), expected, **TOLERANCE[q_dtype])
    assert_matches(run_kernel(batch, k_scale=k_scale, v_scale=v_scale, num_splits=2), expected)
    assert_matches(run_kernel(batch, k_scale=k_scale, v_scale=v_scale, num_splits=1), expected)


def test_fp8_subnormal_values_come_back_exactly():
    # A one-key context returns its value row: rows made of every finite e4m3 code, subnormals included.
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[torch.isfinite(codes.view(torch.float8_e4m3fn).float())][:240].view(2, 1, 120)
    cache = torch.zeros(2, 2, 16, 1, 128, dtype=torch.uint8)
    cache[1, :, 0, :, :120] = codes  # block b, offset 0: value row of sequence b
    cache = cache.view(torch.float8_e4m3fn)
    q = torch.randn(2, 2, 128)
    out = paged_decode_attention(q, cache, torch.tensor([[0], [1]]), torch.tensor([1, 1]), 0.1, v_scale=0.75)
    expected = cache[1, :, 0].float() * 0.75  # [2, 1, 128] -> both query heads of each sequence
    assert torch.equal(out, expected.expand(2, 2, 128))


def _args(batch: Batch) -> tuple:
    return batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.scale


def gpu_batch(dtype, block_size, num_kv_heads=8, seed=7):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 4097, (64,), generator=gen)
    lens[:4] = torch.tensor([1, 4096, 0, block_size])  # extremes and a padding row
    return make_batch(lens.tolist(), 32, num_kv_heads, 128, block_size, dtype, device="cuda", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_matches_reference_at_realistic_shapes(dtype, block_size):
    batch = gpu_batch(dtype, block_size)
    expected = reference(batch)
    assert_matches(run_kernel(batch), expected)
    assert_matches(run_kernel(batch, num_splits=1), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_mqa_with_sliding_window(dtype):
    batch = gpu_batch(dtype, 16, num_kv_heads=1, seed=8)
    assert_matches(run_kernel(batch, sliding_window=1000, num_splits=5), reference(batch, sliding_window=1000))


@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph_with_new_lengths():
    batch = gpu_batch(torch.bfloat16, 16)
    out = torch.empty_like(batch.q)
    args = (batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.scale)
    paged_decode_attention(*args, max_seq_len=4096, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, max_seq_len=4096, out=out)
    batch.seq_lens.copy_(batch.seq_lens // 2)  # shorter contexts (length 1 becomes a padding row)
    batch.q.copy_(torch.randn_like(batch.q))
    out.fill_(float("nan"))
    graph.replay()
    assert_matches(out, reference(batch))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
def test_gpu_fp8_cache_at_realistic_shapes_and_in_a_cuda_graph(fp8):
    k_scale, v_scale = 16 / torch.finfo(fp8).max, 2.5
    batch = fp8_batch(gpu_batch(torch.float32, 16), fp8, k_scale, v_scale, torch.bfloat16)
    expected = paged_decode_attention_reference(*_args(dequantized(batch, k_scale, v_scale))).to(torch.bfloat16)
    assert_matches(run_kernel(batch, k_scale=k_scale, v_scale=v_scale), expected)
    out = torch.empty_like(batch.q)
    args = (*_args(batch),)
    kwargs = dict(max_seq_len=4096, out=out, k_scale=k_scale, v_scale=v_scale)
    paged_decode_attention(*args, **kwargs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, **kwargs)
    out.fill_(float("nan"))
    graph.replay()
    assert_matches(out, expected)
