"""write_kv scatters key/value rows into the paged cache at their flat slots and skips negative slots.

Runs in Triton's interpreter on CPU (conftest sets TRITON_INTERPRET=1 without a GPU); ``gpu`` tests use
realistic shapes on a real device.
"""

import pytest
import torch

from pagoda_kernels.fp8_codes import quantize_fp8_reference
from pagoda_kernels.kv_write import write_kv, write_kv_reference

NAN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # a copy has no tl.dot: bf16 is exact here too


def poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device="cpu"):
    return torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)


def random_slots(num_tokens, num_slots, num_padding, dtype, generator):
    """Distinct slots scattered over the cache, with num_padding rows set to -1 at random positions."""
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=generator)[:num_padding]] = -1
    return slots.to(dtype)


def assert_same_cache(actual, expected):
    # NaN == NaN here: untouched slots of a poisoned cache must still hold their NaN.
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def test_reference_stores_each_token_at_its_flat_slot():
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    slots = torch.tensor([5, 0, 33, -1, 17, 63])
    cache = poisoned_cache(4, 16, 2, 8, torch.float32)
    write_kv_reference(key, value, cache, slots)
    flat_k, flat_v = cache[0].view(-1, 2, 8), cache[1].view(-1, 2, 8)  # slot s = block * block_size + offset
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[token]) and torch.equal(flat_v[slot], value[token])
    written = slots[slots >= 0]
    assert torch.isnan(flat_k[[s for s in range(64) if s not in written.tolist()]]).all()


@pytest.mark.parametrize("dtype", NAN_DTYPES)
@pytest.mark.parametrize(
    "num_kv_heads, head_dim, block_size",
    [(1, 8, 16), (2, 64, 32), (4, 128, 16), (3, 8, 32)],
    ids=["mqa-d8-b16", "kv2-d64-b32", "kv4-d128-b16", "kv3-d8-b32"],
)
def test_matches_reference_and_skips_negative_slots(dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 5, 23
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = random_slots(num_tokens, num_blocks * block_size, num_padding=4, dtype=torch.int64, generator=gen)
    actual = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    expected = actual.clone()

    write_kv(key, value, actual, slots)
    write_kv_reference(key, value, expected, slots)

    assert_same_cache(actual, expected)
    # Exactly the non-padding tokens landed; every other slot kept its poison.
    written = ~torch.isnan(actual).view(2, -1, num_kv_heads * head_dim).any(dim=-1)  # [2, num_slots]
    assert written.sum().item() == 2 * (num_tokens - 4)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_accepts_int32_and_int64_slot_mappings(slot_dtype):
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(7, 2, 16, generator=gen), torch.randn(7, 2, 16, generator=gen)
    slots = random_slots(7, 3 * 16, num_padding=1, dtype=slot_dtype, generator=gen)
    actual, expected = poisoned_cache(3, 16, 2, 16, torch.float32), poisoned_cache(3, 16, 2, 16, torch.float32)
    write_kv(key, value, actual, slots)
    write_kv_reference(key, value, expected, slots)
    assert_same_cache(actual, expected)


def test_reads_strided_key_and_value_views():
    # k and v sliced out of a fused qkv projection: rows are not contiguous, head_dim is.
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_kv_heads, head_dim = 9, 2, 64
    qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_dim, generator=gen)
    key, value = qkv[:, 2 * num_kv_heads : 3 * num_kv_heads], qkv[:, 3 * num_kv_heads :]
    assert not key.is_contiguous()
    slots = random_slots(num_tokens, 2 * 32, num_padding=0, dtype=torch.int64, generator=gen)
    actual, expected = poisoned_cache(2, 32, 2, 64, torch.float16), poisoned_cache(2, 32, 2, 64, torch.float16)
    write_kv(key, value, actual, slots)  # also casts fp32 activations to the fp16 cache
    write_kv_reference(key, value, expected, slots)
    assert_same_cache(actual, expected)


def test_all_padding_and_empty_batches_leave_the_cache_untouched():
    cache = torch.randn(2, 2, 16, 1, 8)
    before = cache.clone()
    write_kv(torch.randn(3, 1, 8), torch.randn(3, 1, 8), cache, torch.full((3,), -1))
    write_kv(torch.randn(0, 1, 8), torch.randn(0, 1, 8), cache, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "key_shape, slot_mapping, message",
    [
        ((4, 2, 8), torch.zeros(3, dtype=torch.int64), "slot_mapping"),
        ((4, 3, 8), torch.zeros(4, dtype=torch.int64), "do not match"),
        ((4, 2, 8), torch.zeros(4, dtype=torch.float32), "int32 or int64"),
    ],
)
def test_rejects_mismatched_inputs(key_shape, slot_mapping, message):
    cache = torch.zeros(2, 2, 16, 2, 8)
    key = torch.randn(key_shape)
    with pytest.raises(ValueError, match=message):
        write_kv(key, key.clone(), cache, slot_mapping)


# ---- fp8 caches: codes of value / scale, saturated, rounded to nearest even -------------------------------------
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_edge_values(fp8: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties) and their float32 neighbours,
    subnormals, out-of-range values that must saturate, +-inf, NaN and -0.0."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[torch.isfinite(values)].unique()  # sorted
    mids = (values[1:] + values[:-1]) / 2
    limit = torch.finfo(fp8).max
    special = torch.tensor([limit * 1.01, -limit * 3, 1e30, float("inf"), -float("inf"), float("nan"), -0.0])
    return torch.cat(
        [values, mids, torch.nextafter(mids, values[-1:] * 2), torch.nextafter(mids, values[:1] * 2), special]
    )


def assert_same_codes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    nan = torch.isnan(expected.float())
    assert torch.isnan(actual.float())[nan].all()
    assert torch.equal(actual.view(torch.uint8)[~nan], expected.view(torch.uint8)[~nan])


def test_quantize_reference_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([448.0, 449.0, 1e6, -float("inf"), 17.0, 19.0, 2.0**-10, 3 * 2.0**-10])
    codes = quantize_fp8_reference(x, 1.0, torch.float8_e4m3fn).float()
    # 17 is the tie between 16 and 18 (step 2): even mantissa 16; 19 ties 18/20: 20. 2^-10 is half the smallest
    # subnormal 2^-9: even 0; 3 * 2^-10 ties 2^-9 / 2^-8: 2^-8.
    assert codes.tolist() == [448.0, 448.0, 448.0, -448.0, 16.0, 20.0, 0.0, 2.0**-8]
    assert quantize_fp8_reference(torch.tensor([1e6]), 2.0, torch.float8_e5m2).item() == 57344.0


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype, k_scale, v_scale", [(torch.float32, 1.0, 1.0), (torch.bfloat16, 0.37, 3.0)])
def test_fp8_cache_gets_the_reference_codes_for_every_edge_value(fp8, dtype, k_scale, v_scale):
    values = fp8_edge_values(fp8)
    num_tokens = -(-len(values) // 16)
    padded = torch.cat([values, torch.randn(num_tokens * 16 - len(values))])
    key = padded.view(num_tokens, 2, 8).to(dtype)
    value = key.flip(0) * 0.5
    slots = random_slots(num_tokens, num_tokens + 8, num_padding=3, dtype=torch.int64, generator=torch.Generator())
    actual = torch.zeros(2, -(-(num_tokens + 8) // 4), 4, 2, 8, dtype=fp8)
    expected = actual.clone()

    write_kv(key, value, actual, slots, k_scale=k_scale, v_scale=v_scale)
    write_kv_reference(key, value, expected, slots, k_scale=k_scale, v_scale=v_scale)

    assert_same_codes(actual, expected)
    limit = torch.finfo(fp8).max
    assert (expected.float().abs() == limit).sum() >= 4  # the out-of-range values saturated


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_matches_reference_at_realistic_shapes(dtype, block_size):
    gen = torch.Generator(device="cuda").manual_seed(4)
    num_tokens, num_kv_heads, head_dim, num_blocks = 4096, 8, 128, 1024
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[::17] = -1
    actual = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device="cuda")
    expected = actual.clone()
    write_kv(key, value, actual, slots.to(torch.int32))
    write_kv_reference(key, value, expected, slots)
    assert_same_cache(actual, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
def test_gpu_fp8_cache_gets_the_reference_codes(fp8):
    gen = torch.Generator(device="cuda").manual_seed(5)
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 4096, 8, 128, 512, 16
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16) * 40
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[::17] = -1
    actual = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=fp8, device="cuda")
    expected = actual.clone()
    write_kv(key, value, actual, slots.to(torch.int32), k_scale=0.1, v_scale=0.7)
    write_kv_reference(key, value, expected, slots, k_scale=0.1, v_scale=0.7)
    assert_same_codes(actual, expected)
