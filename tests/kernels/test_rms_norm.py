"""rms_norm / fused_add_rms_norm kernels against their torch references (HF LlamaRMSNorm numerics).

Without a GPU the kernels run in Triton's interpreter (fp32 and fp16, small shapes); ``gpu`` tests
repeat the comparison in bf16/fp16 at model sizes.
"""

from __future__ import annotations

import pytest
import torch

from pagoda_kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_reference, rms_norm, rms_norm_reference

EPS = 1e-6
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}
GPU_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=1e-3, atol=1e-3)}


# Outputs come from torch.empty: poison it (tests/kernels/conftest.py) so unwritten elements show up.
pytestmark = pytest.mark.usefixtures("poisoned_allocations")


def _inputs(rows: int, hidden: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen, device=device).mul_(3.0).to(dtype)  # [rows, hidden]
    weight = (1.0 + 0.5 * torch.randn(hidden, generator=gen, device=device)).to(dtype)  # [hidden]
    residual = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)  # [rows, hidden]
    return x, weight, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [8, 288, 1000])
@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    x, weight, _ = _inputs(rows, hidden, dtype)
    out = rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [288, 1000])
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_add_rms_norm_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    x, weight, residual = _inputs(rows, hidden, dtype)
    normed, summed = fused_add_rms_norm(x, residual, weight, EPS)
    ref_normed, ref_summed = fused_add_rms_norm_reference(x, residual, weight, EPS)
    # The sum is one rounding of the same float32 addition in both: bit-identical.
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])


def test_fp16_rounds_before_the_weight_multiply_like_hf() -> None:
    # Tolerances hide a one-ulp rounding-order change; bit-exact agreement on almost every element does
    # not: multiplying by the weight in float32 and rounding once disagrees with HF on many elements.
    x, weight, _ = _inputs(64, 1000, torch.float16, seed=1)
    out = rms_norm(x, weight, EPS)
    ref = rms_norm_reference(x, weight, EPS)
    x32 = x.float()
    fused_once = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).half()
    assert (fused_once != ref).float().mean() > 0.05  # the check below can tell the two orders apart
    assert (out == ref).float().mean() > 0.99


def test_rows_may_be_strided_slices_of_a_wider_tensor() -> None:
    wide, weight, residual_wide = _inputs(6, 400, torch.float32)
    x, residual = wide[:, :288], residual_wide[:, 100:388]  # row strides 400, not 288
    w = weight[:288].contiguous()
    torch.testing.assert_close(rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS), **TOL[torch.float32])
    normed, summed = fused_add_rms_norm(x, residual, w, EPS)
    ref_normed, ref_summed = fused_add_rms_norm_reference(x, residual, w, EPS)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_head_norm_of_a_split_qkv_view(dtype: torch.dtype) -> None:
    # Qwen3 normalises q and k per head: [num_tokens, num_heads, head_dim] views into the qkv projection.
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)  # strides (qkv width, head_dim, 1)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    weight = torch.randn(head_dim).to(dtype)
    for view in (q, k):
        assert not view.is_contiguous()
        out = rms_norm(view, weight, EPS)
        assert out.shape == view.shape
        torch.testing.assert_close(out, rms_norm_reference(view, weight, EPS), **TOL[dtype])


def test_inputs_are_not_modified() -> None:
    x, weight, residual = _inputs(3, 288, torch.float16)
    x0, residual0 = x.clone(), residual.clone()
    fused_add_rms_norm(x, residual, weight, EPS)
    rms_norm(x, weight, EPS)
    assert torch.equal(x, x0) and torch.equal(residual, residual0)


def test_zero_rows_give_an_empty_result() -> None:
    x, weight, residual = _inputs(0, 288, torch.float32)
    assert rms_norm(x, weight, EPS).shape == (0, 288)
    normed, summed = fused_add_rms_norm(x, residual, weight, EPS)
    assert normed.shape == summed.shape == (0, 288)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_is_the_engine_rms_norm_bit_for_bit(dtype: torch.dtype) -> None:
    from pagoda.layers.norm import RMSNorm  # imported here so the kernel tests do not depend on the engine

    x, weight, _ = _inputs(4, 288, dtype)
    module = RMSNorm(288, EPS, dtype)
    module.weight.data.copy_(weight)
    assert torch.equal(rms_norm_reference(x, weight, EPS), module(x))


def test_bad_arguments_raise_value_error() -> None:
    x, weight, residual = _inputs(2, 288, torch.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, weight[:100], EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, residual[:1], weight, EPS)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, residual.half(), weight, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_gpu_rms_norm_model_sizes(hidden: int, dtype: torch.dtype) -> None:
    x, weight, _ = _inputs(2048, hidden, dtype, device="cuda")
    out = rms_norm(x, weight, EPS)
    ref = rms_norm_reference(x, weight, EPS)
    torch.testing.assert_close(out, ref, **GPU_TOL[dtype])
    # Only the float32 reduction order differs from torch, so nearly every element is bit-identical.
    assert (out == ref).float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_gpu_fused_add_rms_norm_model_sizes(hidden: int, dtype: torch.dtype) -> None:
    x, weight, residual = _inputs(2048, hidden, dtype, device="cuda")
    normed, summed = fused_add_rms_norm(x, residual, weight, EPS)
    ref_normed, ref_summed = fused_add_rms_norm_reference(x, residual, weight, EPS)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **GPU_TOL[dtype])
    assert (normed == ref_normed).float().mean() > 0.99
