"""apply_rotary kernel (rotate-half RoPE of q and k in one launch) against its torch reference.

The kernel rounds each product to the activation dtype before the add, as the reference (the engine's
expression, transformers' order) does, so in 16-bit dtypes the two are bit-identical. Without a GPU the kernel runs in Triton's interpreter (fp32, fp16, small shapes).
"""

from __future__ import annotations

import pytest
import torch

from pagoda_kernels import rotary
from pagoda_kernels.rotary import apply_rotary, apply_rotary_reference

# fp16: the reference rounds x*cos and rotate_half(x)*sin before adding them; where they nearly cancel
# its absolute error is about one ulp of the products (|x| up to ~4), hence the wider atol.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=4e-3)}
# Millions of elements reach |x| ~ 11, so the reference's cancelling products carry up to one ulp at 8-16.
GPU_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=8e-2), torch.float16: dict(rtol=2e-3, atol=1e-2)}


# Outputs come from torch.empty: poison it (tests/kernels/conftest.py) so unwritten elements show up.
pytestmark = pytest.mark.usefixtures("poisoned_allocations")


def _cos_sin(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's tables (theta 10000): cat(freqs, freqs), rounded to the activation dtype. Each [num_tokens, head_dim]."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _split_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device="cpu"):
    """q, k as the model gets them: per-head views of one fused qkv row (token stride > heads * head_dim)."""
    gen = torch.Generator(device=device).manual_seed(num_tokens * 1000 + head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (2.0 * torch.randn(num_tokens, width, generator=gen, device=device)).to(dtype)  # [num_tokens, width]
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_split_qkv_views_match_reference(num_tokens: int, head_dim: int, dtype: torch.dtype) -> None:
    q, k = _split_qkv(num_tokens, 4, 2, head_dim, dtype)
    assert num_tokens == 1 or q.stride(0) == k.stride(0) == 8 * head_dim  # rows of the whole qkv projection
    cos, sin = _cos_sin(torch.arange(100, 100 + num_tokens), head_dim, dtype)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == k_out.dtype == dtype
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])
    if dtype != torch.float32:  # each product is rounded to the dtype, as the reference does: bit-identical
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_both_halves_of_cos_and_sin_are_used() -> None:
    # Real tables repeat freqs in both halves; random ones catch a kernel that reads only the first half.
    q, k = _split_qkv(3, 2, 1, 16, torch.float32)
    cos, sin = torch.randn(3, 16), torch.randn(3, 16)
    for out, ref in zip(apply_rotary(q, k, cos, sin), apply_rotary_reference(q, k, cos, sin)):
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_many_heads_span_several_head_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shrinking the per-program budget to 2 heads of head_dim 128 makes q (7 heads) and k (3) ragged blocks.
    monkeypatch.setattr(rotary, "_BLOCK_ELEMS", 128)
    q, k = _split_qkv(3, 7, 3, 128, torch.float32)
    cos, sin = _cos_sin(torch.tensor([0, 17, 4095]), 128, torch.float32)
    for out, ref in zip(apply_rotary(q, k, cos, sin), apply_rotary_reference(q, k, cos, sin)):
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("num_kv_heads", [0, 1])
def test_k_with_one_or_no_heads(num_kv_heads: int) -> None:
    # MQA has one kv head; the engine rotates a lone tensor by passing a k with zero heads.
    q, k = _split_qkv(4, 4, num_kv_heads, 64, torch.float32)
    cos, sin = _cos_sin(torch.arange(4), 64, torch.float32)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
    torch.testing.assert_close(q_out, q_ref, **TOL[torch.float32])
    assert k_out.shape == k.shape
    torch.testing.assert_close(k_out, k_ref, **TOL[torch.float32])


def test_position_zero_is_the_identity_and_inputs_are_not_modified() -> None:
    q, k = _split_qkv(2, 2, 2, 8, torch.float16)
    q0, k0 = q.clone(), k.clone()
    cos, sin = _cos_sin(torch.zeros(2, dtype=torch.int64), 8, torch.float16)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    assert torch.equal(q_out, q0) and torch.equal(k_out, k0)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_is_the_engine_rotary_bit_for_bit(dtype: torch.dtype) -> None:
    from pagoda.layers.rotary import apply_rotary as engine_apply_rotary  # kernel tests need not import the engine

    q, k = _split_qkv(3, 4, 2, 64, dtype)
    cos, sin = _cos_sin(torch.arange(3), 64, dtype)
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
    assert torch.equal(q_ref, engine_apply_rotary(q, cos, sin))
    assert torch.equal(k_ref, engine_apply_rotary(k, cos, sin))


def test_bad_arguments_raise_value_error() -> None:
    q, k = _split_qkv(2, 2, 1, 8, torch.float32)
    cos, sin = _cos_sin(torch.arange(2), 8, torch.float32)
    with pytest.raises(ValueError, match="even"):
        apply_rotary(q[..., :7], k[..., :7], cos[:, :7], sin[:, :7])
    with pytest.raises(ValueError, match="cos must be"):
        apply_rotary(q, k, cos[:1], sin)
    with pytest.raises(ValueError, match="dtype"):
        apply_rotary(q, k, cos.half(), sin.half())
    with pytest.raises(ValueError, match="must match q"):
        apply_rotary(q, k[:1], cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (32, 32, 64), (8, 4, 8)])
def test_gpu_model_sizes(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    q, k = _split_qkv(2048, num_heads, num_kv_heads, head_dim, dtype, device="cuda")
    cos, sin = _cos_sin(torch.arange(2048, device="cuda") * 3, head_dim, dtype)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
    torch.testing.assert_close(q_out, q_ref, **GPU_TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **GPU_TOL[dtype])
    # Products are rounded to the dtype before the add, exactly like the reference.
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
