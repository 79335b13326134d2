"""The native CPU paged-attention kernel agrees with the SDPA path of the torch backend.

``pagoda_cpu::paged_attention`` reads K/V blocks in place through the block tables for a whole
varlen batch (decodes, prefill chunks with cached prefixes, sliding windows, GQA). The reference is
the same backend with the native kernel switched off: gathered contexts through SDPA.
"""

import pytest
import torch
from attention_helpers import random_paged_step

import pagoda.attention.torch_backend as attention
from pagoda.attention.protocol import AttentionLayerSpec, build_metadata, quantize_kv
from pagoda.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(
    not attention._native_attention_built(), reason="native CPU kernels unavailable (no compiler or no AVX-512)"
)


def make_step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    *tensors, tables = random_paged_step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, 3, seed)
    q, k, v, kv_cache = (t.to(dtype) for t in tensors)
    return q, k, v, kv_cache, build_metadata(query_lens, seq_lens, tables, block_size)


def attend(step, spec, native: bool, monkeypatch):
    q, k, v, kv_cache, meta = step
    cache = kv_cache.clone()
    backend = TorchAttentionBackend()
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(attention, "native_attention_applies", lambda q, spec: False)
        assert attention.native_attention_applies(q, spec) == native
        backend.prepare(meta)
        out = backend.forward(q, k, v, cache, meta, spec)
    return out, cache


CASES = {
    "decodes of uneven lengths": ([1, 1, 1, 1], [1, 17, 40, 97]),
    "one prefill, no cache": ([45], [45]),
    "prefill chunks after cached prefixes": ([20, 9], [50, 9 + 33]),
    "mixed prefill and decodes": ([7, 1, 20, 1], [7, 40, 50, 3]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 128])  # bf16 decode rows at 128 take the vdpbf16ps decode stages
def test_native_kernel_matches_sdpa(case, window, heads, dtype, head_dim, monkeypatch):
    num_heads, num_kv_heads = heads
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, window)
    step = make_step(*CASES[case], num_heads, num_kv_heads, head_dim, block_size=16, dtype=dtype)
    want, want_cache = attend(step, spec, native=False, monkeypatch=monkeypatch)
    got, got_cache = attend(step, spec, native=True, monkeypatch=monkeypatch)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got_cache, want_cache)  # both write this step's K/V through the slot mapping
    # float32 inside both; the outputs differ by the final rounding to 16 bits (and SDPA's blocking)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])  # 5: blocks straddle KV chunks; 70 = 14 x 5
def test_native_kernel_handles_head_sizes_and_block_sizes(head_dim, block_size, monkeypatch):
    spec = AttentionLayerSpec(4, 2, head_dim, head_dim**-0.5)
    step = make_step([1, 12, 1], [70, 12, 33], 4, 2, head_dim, block_size, torch.bfloat16, seed=head_dim)
    want, _ = attend(step, spec, native=False, monkeypatch=monkeypatch)
    got, _ = attend(step, spec, native=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_float32_on_the_op_itself_is_exact_to_float_rounding():
    # the backend keeps SDPA for float32; the op still accepts it, which pins the kernel's own arithmetic
    spec = AttentionLayerSpec(4, 2, 32, 32**-0.5, 5)
    q, k, v, kv_cache, meta = make_step([3, 1], [40, 8], 4, 2, 32, 16, torch.float32)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    want = backend.forward(q, k, v, kv_cache, meta, spec)  # float32: SDPA path, and the cache now holds k/v
    got = torch.ops.pagoda_cpu.paged_attention(
        q,
        kv_cache[0],
        kv_cache[1],
        meta.block_tables,
        torch.tensor(meta.query_start_loc),
        torch.tensor(meta.seq_lens),
        spec.scale,
        5,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_float32_and_odd_head_sizes_keep_sdpa():
    q = torch.zeros(1, 4, 32, dtype=torch.bfloat16)
    assert attention.native_attention_applies(q, AttentionLayerSpec(4, 2, 32, 1.0))
    assert not attention.native_attention_applies(q.float(), AttentionLayerSpec(4, 2, 32, 1.0))
    assert not attention.native_attention_applies(q[..., :8], AttentionLayerSpec(4, 2, 8, 1.0))


def test_bad_shapes_raise_instead_of_reading_out_of_bounds():
    q, k, v, kv_cache, meta = make_step([1], [20], 4, 2, 32, 16, torch.bfloat16)
    starts, lens = torch.tensor(meta.query_start_loc), torch.tensor(meta.seq_lens)
    with pytest.raises(RuntimeError, match="bad lengths"):  # more context than the block table holds
        torch.ops.pagoda_cpu.paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, starts, lens * 10, 1.0, 0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.pagoda_cpu.paged_attention(
            q[..., :8].contiguous(),
            kv_cache[0][..., :8].contiguous(),
            kv_cache[1][..., :8].contiguous(),
            meta.block_tables,
            starts,
            lens,
            1.0,
            0,
        )


@pytest.mark.parametrize("num_reqs", [1, 3, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_tasks_spanning_several_kv_heads_match_sdpa(num_reqs, head_dim, monkeypatch):
    # decode tasks take a group of KV heads sized by batch and thread count (8 heads over 3 requests:
    # groups of 3, 3 and 2); every grouping gives each row the same arithmetic
    spec = AttentionLayerSpec(16, 8, head_dim, head_dim**-0.5)
    lens = [1 + (37 * i) % 90 for i in range(num_reqs)]
    step = make_step([1] * num_reqs, lens, 16, 8, head_dim, 16, torch.bfloat16, seed=num_reqs)
    want, _ = attend(step, spec, native=False, monkeypatch=monkeypatch)
    got, _ = attend(step, spec, native=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone, _ = attend(step, spec, native=True, monkeypatch=monkeypatch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, got)  # the task split never changes a result


def test_block_table_entries_outside_the_cache_raise():
    q, k, v, kv_cache, meta = make_step([1], [20], 4, 2, 32, 16, torch.bfloat16)
    starts, lens = torch.tensor(meta.query_start_loc), torch.tensor(meta.seq_lens)
    tables = meta.block_tables.clone()
    tables[0, 1] = kv_cache.shape[1]  # one past the last block, read by positions 16..19
    with pytest.raises(RuntimeError, match="must index the cache"):
        torch.ops.pagoda_cpu.paged_attention(q, kv_cache[0], kv_cache[1], tables, starts, lens, 1.0, 0)


def test_key_value_views_of_a_fused_qkv_row_are_written_like_index_copy(monkeypatch):
    # the model hands k and v as per-head views of its fused qkv output (token stride > kv_heads * head_dim)
    spec = AttentionLayerSpec(4, 2, 32, 32**-0.5)
    q, _, _, kv_cache, meta = make_step([5, 1], [5, 30], 4, 2, 32, 16, torch.bfloat16, seed=3)
    qkv = torch.randn(6, (4 + 2 + 2) * 32).to(torch.bfloat16)
    k = qkv[:, 4 * 32 : 6 * 32].view(6, 2, 32)
    v = qkv[:, 6 * 32 :].view(6, 2, 32)
    assert not k.is_contiguous()
    want, want_cache = attend((q, k, v, kv_cache, meta), spec, native=False, monkeypatch=monkeypatch)
    got, got_cache = attend((q, k, v, kv_cache, meta), spec, native=True, monkeypatch=monkeypatch)
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_slots_outside_the_cache_raise_before_anything_is_written():
    q, k, v, kv_cache, meta = make_step([2], [2], 4, 2, 32, 16, torch.bfloat16)
    starts, lens = torch.tensor(meta.query_start_loc), torch.tensor(meta.seq_lens)
    before = kv_cache.clone()
    slots = torch.tensor([0, kv_cache.shape[1] * kv_cache.shape[2]])  # the second is one past the last slot
    with pytest.raises(RuntimeError, match="must index the cache"):
        torch.ops.pagoda_cpu.paged_attention(
            q, kv_cache[0], kv_cache[1], meta.block_tables, starts, lens, 1.0, 0, k, v, slots
        )
    assert torch.equal(kv_cache, before)
    with pytest.raises(RuntimeError, match="come together"):
        torch.ops.pagoda_cpu.paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, starts, lens, 1.0, 0, k)


# ---- fp8 caches: the kernel writes codes of K / k_scale and V / v_scale and reads code * scale --------------------
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_step(step, fp8: torch.dtype, k_scale: float, v_scale: float):
    """``step`` over an fp8 cache: its random contents quantized through the scales."""
    q, k, v, kv_cache, meta = step
    cache = torch.stack([quantize_kv(kv_cache[0], k_scale, fp8), quantize_kv(kv_cache[1], v_scale, fp8)])
    return q, k, v, cache, meta


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, head_dim, window", [((8, 2), 128, None), ((4, 2), 32, 9)])
def test_fp8_cache_native_kernel_matches_sdpa(fp8, case, dtype, heads, head_dim, window, monkeypatch):
    # bf16 at 128 with 4 query heads per KV head takes the vdpbf16ps tiles (decode rows too); fp16 and the
    # 2-head groups of bf16 decode rows the float32 stages
    k_scale, v_scale = 2 / torch.finfo(fp8).max, 0.5  # keys beyond +-2 saturate
    spec = AttentionLayerSpec(*heads, head_dim, head_dim**-0.5, window, k_scale=k_scale, v_scale=v_scale)
    step = fp8_step(make_step(*CASES[case], *heads, head_dim, block_size=16, dtype=dtype), fp8, k_scale, v_scale)
    want, want_cache = attend(step, spec, native=False, monkeypatch=monkeypatch)
    got, got_cache = attend(step, spec, native=True, monkeypatch=monkeypatch)
    assert got.dtype == dtype and got_cache.dtype == fp8
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))  # the same codes written
    assert (got_cache[0].float().abs() == torch.finfo(fp8).max).any()  # some keys saturated
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def finite_codes(fp8: torch.dtype, count: int) -> torch.Tensor:
    """The format's finite codes (subnormals included) as uint8, cycled to ``count``."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[torch.isfinite(codes.view(fp8).float())]
    return codes.repeat(-(-count // len(codes)))[:count]


def one_token_requests(values: torch.Tensor, heads: int) -> tuple:
    """A decode request per row of ``values`` [n, head_dim] (uint8 codes), each with a context of two tokens in
    its own block: token 0 has key = value = that row, token 1 zeros. (tables, query_start_loc, seq_lens, cache)."""
    n, head_dim = values.shape
    cache = torch.zeros(2, n, 16, 1, head_dim, dtype=torch.uint8)
    cache[:, :, 0, 0] = values
    tables = torch.arange(n).unsqueeze(1)
    return tables, torch.arange(n + 1), torch.full((n,), 2), cache


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_keys_including_subnormals_are_widened_exactly(fp8, dtype):
    # Query head h is 8 * e_h: its score for token 0 is 64 * k0[h] (scale 8), for token 1 zero, so its output's
    # dim 0 (v0[0] = 1, v1 = 0) is sigmoid(64 * k0[h]): a subnormal key read as 0 would be off by ~1e-3.
    head_dim = 16
    keys = finite_codes(fp8, 16 * head_dim).view(16, head_dim)
    tables, starts, lens, cache = one_token_requests(keys, head_dim)
    cache[1] = 0
    cache[1, :, 0, 0, 0] = torch.tensor([1.0]).to(fp8).view(torch.uint8)
    cache = cache.view(fp8)
    q = (8 * torch.eye(head_dim)).expand(16, head_dim, head_dim).to(dtype)  # [requests, heads, head_dim]
    out = torch.ops.pagoda_cpu.paged_attention(
        q, cache[0], cache[1], tables, starts, lens, 8.0, 0, None, None, None, 1.0, 1.0
    )
    expected = torch.sigmoid(64 * cache[0, :, 0, 0].double())  # [requests, heads]
    torch.testing.assert_close(out[..., 0].double(), expected, atol=2e-6 if dtype == torch.float32 else 1e-3, rtol=0)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype, num_heads", [(torch.float32, 2), (torch.float16, 2), (torch.bfloat16, 8)])
def test_fp8_values_including_subnormals_are_widened_exactly(fp8, dtype, num_heads):
    # With zero keys and queries both context tokens weigh 1/2: the output is (v0 + 0) / 2 * v_scale, exact in
    # float32 (and one rounding in 16 bits); bf16 with 8 heads per KV head runs the vdpbf16ps tiles.
    values = finite_codes(fp8, 8 * 128).view(8, 128)
    tables, starts, lens, cache = one_token_requests(values, 128)
    cache[0] = 0
    cache = cache.view(fp8)
    q = torch.zeros(8, num_heads, 128, dtype=dtype)
    out = torch.ops.pagoda_cpu.paged_attention(
        q, cache[0], cache[1], tables, starts, lens, 0.1, 0, None, None, None, 1.0, 0.75
    )
    expected = (cache[1, :, 0, 0].float() * 0.75 / 2).to(dtype)  # [requests, head_dim]
    assert torch.equal(out, expected.unsqueeze(1).expand_as(out))


def test_fp8_cache_with_a_model_dtype_key_is_written_once_per_token(monkeypatch):
    # float32 rows into an fp8 cache through the op (the backend never sends float32 to it, the op takes them)
    q, k, v, kv_cache, meta = make_step([3, 1], [3, 20], 4, 2, 32, 16, torch.float32, seed=4)
    cache = torch.zeros_like(kv_cache, dtype=torch.float8_e5m2)
    torch.ops.pagoda_cpu.paged_attention(
        q, cache[0], cache[1], meta.block_tables, torch.tensor(meta.query_start_loc), torch.tensor(meta.seq_lens),
        0.1, 0, k, v, meta.slot_mapping, 0.5, 2.0,
    )  # fmt: skip
    flat = cache.view(2, -1, 2, 32)[:, meta.slot_mapping]
    assert torch.equal(flat[0].view(torch.uint8), quantize_kv(k, 0.5, torch.float8_e5m2).view(torch.uint8))
    assert torch.equal(flat[1].view(torch.uint8), quantize_kv(v, 2.0, torch.float8_e5m2).view(torch.uint8))
