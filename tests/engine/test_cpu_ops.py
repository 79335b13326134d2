"""The native fused CPU ops (pagoda/cpu/fused_ops.cpp) round exactly like the PyTorch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.cpu import argmax_rows, cpu_ops, use_fused_ops

pytestmark = pytest.mark.skipif(not cpu_ops(), reason="native CPU kernels could not be built (no compiler)")
DTYPES = [torch.bfloat16, torch.float16]


def _rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _fraction_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype
    return float((a == b).float().mean())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64, 700])
@pytest.mark.parametrize("hidden", [1000, 1024])  # 1024: the 16-lane vector path of bf16
def test_rms_norm_and_fused_residual_add(dtype: torch.dtype, rows: int, hidden: int) -> None:
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    # the float32 sum of squares may be ordered differently: allow a rare last-bit difference
    assert _fraction_equal(torch.ops.pagoda_cpu.rms_norm(x, weight, 1e-6), _rms_reference(x, weight, 1e-6)) > 0.999
    normed, summed = torch.ops.pagoda_cpu.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert _fraction_equal(normed, _rms_reference(x + residual, weight, 1e-6)) > 0.999


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_heads_of_a_strided_qkv_view(dtype: torch.dtype) -> None:
    qkv = torch.randn(5, (4 + 2 + 2) * 16).to(dtype)
    k = qkv[:, 64:96].view(5, 2, 16)  # not contiguous: rows are 128 apart
    weight = torch.randn(16).to(dtype)
    assert _fraction_equal(torch.ops.pagoda_cpu.rms_norm(k, weight, 1e-6), _rms_reference(k, weight, 1e-6)) > 0.999


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [8, 64, 128])  # 64 and 128: the bf16 vector path
def test_rotary_is_bit_identical_to_the_rotate_half_expression(dtype: torch.dtype, head_dim: int) -> None:
    torch.manual_seed(head_dim)
    qkv = torch.randn(7, 6 * head_dim).to(dtype)
    q = qkv[:, : 4 * head_dim].view(7, 4, head_dim)  # a strided view, as the model passes it
    angles = torch.randn(7, head_dim // 2).repeat(1, 2) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    half = head_dim // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    expected = q * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    assert torch.equal(torch.ops.pagoda_cpu.rotary(q, cos, sin), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_silu_and_mul_matches_silu_times_up(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * 3072 + 2 * 7) * 4).to(dtype)  # a tail past the 16-lane vectors
    gate, up = x.chunk(2, dim=-1)
    assert _fraction_equal(torch.ops.pagoda_cpu.silu_and_mul(x), F.silu(gate) * up) > 0.999


def test_fused_ops_serve_16_bit_cpu_activations_only() -> None:
    assert use_fused_ops(torch.zeros(1, dtype=torch.bfloat16))
    assert not use_fused_ops(torch.zeros(1, dtype=torch.float32))  # float32 stays on PyTorch, bit-exact to HF


@pytest.mark.parametrize("width", [1, 17, 32, 33, 1000, 151936])  # below, at and past the 16-lane vector path
def test_argmax_rows_returns_torch_argmax_including_ties(width: int) -> None:
    torch.manual_seed(width)
    logits = torch.randn(9, width)
    for row, ties in enumerate(range(1, 4)):  # the maximum repeated at random places: the first one wins
        places = torch.randint(0, width, (ties,))
        logits[row, places] = logits.max() + 1
    logits[5] = logits[5].round()  # many exact ties among lower values
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(argmax_rows(logits[::2]), logits[::2].argmax(dim=-1))  # a strided view


def test_argmax_rows_handles_nan_and_infinities_like_torch() -> None:
    logits = torch.randn(4, 100)
    logits[0, 70] = float("nan")  # in the vector part: NaN counts as the largest
    logits[1, 99] = float("nan")  # in the tail
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")  # nothing finite: index 0
    logits[0, 80] = float("nan")
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits).tolist() == [70, 99, 5, 0]


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_start() -> None:
    # torch's build lock is a plain file; a process killed while compiling leaves it behind. The next start must
    # load the kernels (here already built) instead of waiting for that file forever.
    import subprocess
    import sys

    from pagoda.cpu import _build_dir

    if not cpu_ops():
        pytest.skip("the native CPU kernels do not build on this machine")
    (_build_dir() / "lock").touch()
    code = "from pagoda.cpu import cpu_ops; assert cpu_ops()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "removing a stale build lock" in result.stderr
    assert not (_build_dir() / "lock").exists()
