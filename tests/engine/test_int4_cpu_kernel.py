"""The CPU group-quantized linear kernel (pagoda/layers/int4_cpu.py, pagoda/cpu/packed_linear_int4.cpp) computes
``x[..., perm] @ IntWeight.dequantize().T + bias``: the native kernel to its bf16 output rounding, the plain-torch
fallback to float32 rounding."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import pagoda.cpu
import pagoda.layers.int4_cpu as int4_cpu
from pagoda.layers.int4_cpu import Int4CpuLinear, int4_native_available, pack_int_weight, unpack_int_weight
from pagoda.quantization.weights import IntWeight

needs_native = pytest.mark.skipif(not int4_native_available(), reason="no AVX512-BF16 build of the native kernels")

# (out, in, group_size, bits, act-order perm, float16 scales): ragged outputs (not whole 64-row tiles), group sizes
# 32/64/128 and the whole input, inputs that end in a partial chunk of the many-row passes (1088 = 34 groups of 32;
# the passes take 32 such groups per chunk), an odd 8-bit group (no k pairs to widen many rows into), and scales
# that are exact in float16 (checkpoints': packed as float16) or not (packed as float32).
SHAPES = [
    (64, 64, 32, 4, False, False),
    (100, 256, 64, 4, True, True),
    (130, 384, 128, 4, False, True),
    (72, 1088, 32, 4, True, False),
    (70, 96, 96, 4, False, True),
    (100, 256, 64, 8, True, False),
    (64, 1152, 128, 8, False, True),
    (40, 160, 160, 8, False, False),
    (40, 99, 99, 8, False, True),
]
Shape = tuple[int, int, int, int, bool, bool]


def shape_id(shape: Shape) -> str:
    out, inp, group_size, bits, perm, half = shape
    return f"{out}x{inp}-g{group_size}-{bits}bit" + ("-perm" if perm else "") + ("-fp16" if half else "")


ROWS = [1, 2, 7, 32, 100, 300]


def random_int_weight(
    out: int, inp: int, group_size: int, bits: int, perm: bool, half: bool = False, seed: int = 0
) -> IntWeight:
    """Uniform integers, zero points and scales near a checkpoint's (about 0.02 / 2**(bits - 4)); ``half``: scales
    that are float16 values."""
    g = torch.Generator().manual_seed(seed)
    groups = inp // group_size
    scales = (torch.rand(groups, out, generator=g) + 0.5) * 0.02 / 2 ** (bits - 4)
    return IntWeight(
        torch.randint(0, 2**bits, (out, inp), generator=g, dtype=torch.uint8),
        scales.half().float() if half else scales,
        torch.randint(0, 2**bits, (groups, out), generator=g, dtype=torch.uint8),
        group_size,
        bits,
        torch.randperm(inp, generator=g) if perm else None,
    )


def reference(x: torch.Tensor, weight: IntWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """float64 ``x[..., perm] @ w.T + bias`` of the float32 dequantized weight."""
    xp = x if weight.perm is None else x[..., weight.perm]
    y = xp.double() @ weight.dequantize().double().T
    return y if bias is None else y + bias.double()


def assert_bf16_rounding_of(y: torch.Tensor, x: torch.Tensor, weight: IntWeight, bias: Optional[torch.Tensor]) -> None:
    """y is the reference rounded to bf16: within one bf16 ulp (2**-8 relative; half an ulp is the rounding, the
    other half covers a float32 sum that lands across a rounding boundary) plus the float32 accumulation error of
    the kernel's sums, bounded by 1e-5 of sum |x| |w|."""
    assert y.dtype == torch.bfloat16
    exact = reference(x, weight, bias)
    scale = x.double().abs() @ weight.dequantize().double().abs().T
    err = (y.double() - exact).abs()
    bound = exact.abs() * 2**-8 + scale * 1e-5 + 1e-30
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


def layers(
    shape: Shape, with_bias: bool, gated: bool = False
) -> tuple[IntWeight, Optional[torch.Tensor], Int4CpuLinear]:
    out = shape[0]
    weight = random_int_weight(*shape)
    bias = torch.randn(out, dtype=torch.bfloat16) if with_bias else None
    return weight, bias, Int4CpuLinear.from_int_weight(weight, bias, gated)


@needs_native
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_native_bf16_output_is_the_rounded_reference(shape: Shape) -> None:
    out, inp = shape[:2]
    weight, bias, layer = layers(shape, with_bias=out % 2 == 0)
    assert layer.name == "int4-native"
    for rows in ROWS:
        x = torch.randn(rows, inp, dtype=torch.bfloat16)
        y = layer(x)
        assert y.shape == (rows, out)
        assert_bf16_rounding_of(y, x, weight, bias)
        assert torch.equal(layer.float_output(x), y.float())  # one pass, the same rounding


@needs_native
def test_native_kernel_takes_leading_dims_and_an_empty_batch() -> None:
    _, _, layer = layers((70, 128, 64, 4, True, False), with_bias=False)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    assert torch.equal(layer(x), layer(x.view(6, 128)).view(2, 3, 70))
    assert layer(torch.empty(0, 128, dtype=torch.bfloat16)).shape == (0, 70)


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_kernel_is_silu_and_mul_over_the_plain_kernel_bit_for_bit(bits: int, rows: int, with_bias: bool) -> None:
    weight, bias, plain = layers((192, 256, 64, bits, True, True), with_bias=with_bias)  # [gate | up], 96 + 96
    gated = Int4CpuLinear.from_int_weight(weight, bias, gated=True)
    assert gated.name == "int4-native-gated"
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    assert torch.equal(gated.silu_and_mul(x), torch.ops.pagoda_cpu.silu_and_mul(plain(x)))
    assert torch.equal(gated(x), plain(x))  # as a plain linear: [gate | up] in checkpoint order
    assert torch.equal(gated.float_output(x), plain.float_output(x))
    assert gated.silu_and_mul(x.view(1, rows, 256)).shape == (1, rows, 96)
    assert plain.silu_and_mul(x) is None  # not gated


@needs_native
def test_gated_layer_leaves_other_dtypes_and_partial_tiles_to_the_caller() -> None:
    weight, _, _ = layers((128, 64, 32, 4, False, False), with_bias=False)
    gated = Int4CpuLinear.from_int_weight(weight, None, gated=True)
    x = torch.randn(3, 64)
    assert gated.silu_and_mul(x) is None  # the epilogue rounds to bf16: float32 rows take silu_and_mul(gated(x))
    torch.testing.assert_close(gated(x), reference(x, weight, None).float(), rtol=1e-5, atol=1e-5)
    partial, _, _ = layers((96, 64, 32, 4, False, False), with_bias=False)  # 48 + 48 rows: no whole gated tile
    assert Int4CpuLinear.from_int_weight(partial, None, gated=True).name == "int4-native"


@pytest.mark.parametrize("shape", SHAPES[:3] + SHAPES[5:6], ids=shape_id)
def test_float32_activations_match_the_dequantized_reference_within_float32_rounding(shape: Shape) -> None:
    inp = shape[1]
    weight, bias, layer = layers(shape, with_bias=True)
    for rows in (1, 7, 100):
        x = torch.randn(rows, inp)
        xp = x if weight.perm is None else x[..., weight.perm]
        expected = xp @ weight.dequantize().T + bias.float()
        # the float32 GEMM itself may sum in another order: a few float32 ulps of sum |x| |w|
        scale = (x.abs() @ weight.dequantize_checkpoint_order().abs().T).max()
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=float(scale) * 1e-6)
        assert layer.float_output(x).dtype == torch.float32


@pytest.mark.parametrize("disable", ["int4_native_available", "cpu_ops"])
def test_without_the_native_kernel_the_torch_fallback_serves_every_dtype(
    disable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if disable == "cpu_ops":  # what PAGODA_DISABLE_CPU_OPS or a missing compiler leads to
        monkeypatch.setattr(pagoda.cpu, "cpu_ops", lambda: False)
    else:
        monkeypatch.setattr(int4_cpu, "int4_native_available", lambda: False)
    weight, bias, layer = layers((100, 256, 64, 4, True, False), with_bias=True, gated=True)
    assert layer.name == "int4-torch" and layer.packed is None
    x = torch.randn(5, 256)
    expected = x[..., weight.perm] @ weight.dequantize().T + bias.float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-5)
    xb = x.to(torch.bfloat16)  # dequantized in bf16: the bf16 GEMM of the bf16-rounded weight
    torch.testing.assert_close(
        layer(xb), F.linear(xb[..., weight.perm], weight.dequantize().to(torch.bfloat16), bias), rtol=0, atol=0
    )
    assert layer.silu_and_mul(xb) is None
    assert layer.float_output(x.half()).dtype == torch.float32


def test_an_odd_4_bit_group_has_no_k_pairs_and_takes_the_torch_form() -> None:
    weight, bias, layer = layers((64, 99, 99, 4, False, False), with_bias=True)
    assert layer.name == "int4-torch"
    x = torch.randn(3, 99)
    torch.testing.assert_close(layer(x), reference(x, weight, bias).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_packing_is_lossless_and_reads_a_quarter_of_bf16s_bytes(shape: Shape) -> None:
    out, inp, group_size, bits, _, half = shape
    weight = random_int_weight(*shape)
    packed = pack_int_weight(weight)
    back = unpack_int_weight(packed, out, inp, group_size, bits, weight.perm)
    assert torch.equal(back.qweight, weight.qweight)
    assert torch.equal(back.scales, weight.scales) and torch.equal(back.zeros, weight.zeros)
    # bits / 8 bytes per weight plus a scale (float16 where exact) and a uint8 zero point per group and row, over
    # whole 64-row tiles
    tile_rows = -(-out // 64) * 64
    assert packed.numel() == tile_rows * (inp * bits // 8 + (inp // group_size) * (3 if half else 5))
