"""The CPU FP8 (e4m3fn, weight-only) linear kernel: native (AVX512-BF16 + VBMI) and plain-torch fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagoda.layers.fp8_cpu as fp8_cpu
from pagoda.layers.fp8_cpu import Fp8CpuLinear, fp8_native_available, pack_fp8_weight, unpack_fp8_weight
from pagoda.quantization.weights import Fp8Weight, quantize_fp8_per_row

needs_native_fp8 = pytest.mark.skipif(
    not fp8_native_available(), reason="native fp8 kernel unavailable (no compiler, AVX512-BF16 or AVX512-VBMI)"
)

# neither out a multiple of the 64-row tile nor in of the k pair; more than one 256-pair chunk of k
RAGGED_SHAPES = [(37, 83), (130, 601)]
# up to 24 rows widen in registers (one 6-row pass, or several), more rows widen each chunk once into cache
BATCHES = [1, 2, 7, 32, 100, 300]


def _all_finite_e4m3fn() -> torch.Tensor:
    """Every e4m3fn value but NaN (0x7f, 0xff): 254 values, subnormals and both zeros included."""
    codes = torch.arange(256, dtype=torch.int32)
    return codes[(codes & 0x7F) != 0x7F].to(torch.uint8).view(torch.float8_e4m3fn)


def _random_fp8(out_features: int, in_features: int, seed: int) -> Fp8Weight:
    torch.manual_seed(seed)
    rows = torch.randn(out_features, in_features) * torch.logspace(-2, 1, out_features).unsqueeze(1)
    return quantize_fp8_per_row(rows)


def _reference(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ dequantize().T + bias in float32."""
    y = x.float() @ weight.dequantize().T
    return y if bias is None else y + bias.float()


def _assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 rounding of the output plus float32 summation error."""
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-4 * float(want.abs().max()))


@needs_native_fp8
@pytest.mark.parametrize("rows", [5, 300])  # in registers, and through the widened chunk in cache
def test_every_finite_e4m3fn_value_widens_to_bf16_exactly(rows: int) -> None:
    values = _all_finite_e4m3fn()  # [254]
    # weight [254 + 3, 254]: rows that are the values rotated, so every value meets every k position's lane
    q = torch.stack([values.view(torch.uint8).roll(shift) for shift in range(values.numel() + 3)])
    weight = Fp8Weight(q.view(torch.float8_e4m3fn), torch.ones(q.shape[0]))
    layer = Fp8CpuLinear.from_fp8_weight(weight, None)
    assert layer.name == "fp8-native"
    x = torch.eye(values.numel(), dtype=torch.bfloat16)  # one-hot rows pick out single weights
    for start in range(0, values.numel(), rows):
        got = layer.float_output(x[start : start + rows])
        assert torch.equal(got, weight.qweight.float().T[start : start + rows])


def test_packed_layout_round_trips_every_byte_and_shape() -> None:
    if not fp8_native_available():
        pytest.skip("the packed layout needs the native ops")
    for out_features, in_features in [(1, 1), (64, 64), *RAGGED_SHAPES]:
        q = torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8).view(torch.float8_e4m3fn)
        packed = pack_fp8_weight(q)
        assert packed.dtype == torch.uint8 and packed.shape == (-(-out_features // 64), -(-in_features // 2), 64, 2)
        assert torch.equal(unpack_fp8_weight(packed, out_features, in_features).view(torch.uint8), q.view(torch.uint8))


@needs_native_fp8
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
@pytest.mark.parametrize("rows", BATCHES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_kernel_matches_the_dequantized_product(shape: tuple[int, int], rows: int, with_bias: bool) -> None:
    weight = _random_fp8(*shape, seed=rows)
    bias = torch.randn(shape[0], dtype=torch.bfloat16) if with_bias else None
    layer = Fp8CpuLinear.from_fp8_weight(weight, bias)
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    _assert_bf16_close(got, _reference(x, weight, bias))
    assert torch.equal(layer.float_output(x), got.float())  # one pass, the same rounding


@needs_native_fp8
def test_a_row_gives_the_same_bits_alone_and_in_any_batch() -> None:
    """Both paths (in registers, widened in cache) add each row's products in the same order."""
    weight = _random_fp8(130, 601, seed=3)
    layer = Fp8CpuLinear.from_fp8_weight(weight, torch.randn(130))
    x = torch.randn(300, 601, dtype=torch.bfloat16)
    batch = layer(x)
    for rows in (1, 5, 7, 32):
        assert torch.equal(layer(x[:rows]), batch[:rows])


@needs_native_fp8
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_kernel_is_silu_and_mul_over_the_plain_kernel_bit_for_bit(rows: int, with_bias: bool) -> None:
    inter, in_features = 96, 99
    weight = _random_fp8(2 * inter, in_features, seed=rows)  # [gate | up]
    bias = torch.randn(2 * inter, dtype=torch.bfloat16) if with_bias else None
    plain = Fp8CpuLinear.from_fp8_weight(weight, bias)
    gated = Fp8CpuLinear.from_fp8_weight(weight, bias, gated=True)
    assert (plain.name, gated.name) == ("fp8-native", "fp8-native-gated")
    assert plain.silu_and_mul(torch.randn(1, in_features, dtype=torch.bfloat16)) is None
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    assert torch.equal(gated.silu_and_mul(x), torch.ops.pagoda_cpu.silu_and_mul(plain(x)))
    # called as a plain linear it still returns [gate | up] in checkpoint order
    assert torch.equal(gated(x), plain(x))
    assert torch.equal(gated.float_output(x), plain.float_output(x))
    assert gated.silu_and_mul(x.view(1, rows, in_features)).shape == (1, rows, inter)


@needs_native_fp8
def test_gated_layer_leaves_other_activation_dtypes_to_the_separate_activation() -> None:
    weight, bias = _random_fp8(128, 40, seed=0), torch.randn(128)
    gated = Fp8CpuLinear.from_fp8_weight(weight, bias, gated=True)
    x = torch.randn(3, 40)
    assert gated.silu_and_mul(x) is None
    torch.testing.assert_close(gated(x), _reference(x, weight, bias), rtol=1e-5, atol=1e-5)
    odd = Fp8CpuLinear.from_fp8_weight(_random_fp8(96, 40, seed=1), None, gated=True)  # 48 + 48: no whole tile
    assert not odd.gated and odd.name == "fp8-native"


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rows", [1, 32])
def test_float32_and_float16_activations_dequantize_in_their_dtype(
    monkeypatch: pytest.MonkeyPatch, native: bool, rows: int
) -> None:
    if native and not fp8_native_available():
        pytest.skip("native fp8 kernel unavailable")
    if not native:
        monkeypatch.setattr(fp8_cpu, "fp8_native_available", lambda: False)
    weight, bias = _random_fp8(70, 83, seed=rows), torch.randn(70)
    layer = Fp8CpuLinear.from_fp8_weight(weight, bias)
    assert layer.native == native
    x = torch.randn(2, rows, 83)  # leading dims are kept
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (2, rows, 70)
    torch.testing.assert_close(got, _reference(x, weight, bias), rtol=1e-5, atol=1e-5)
    half = layer(x.half())
    assert half.dtype == torch.float16
    assert torch.equal(half, F.linear(x.half(), weight.dequantize().half(), bias.half()))


def test_fallback_serves_bf16_with_the_dequantized_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native kernel: plain torch on the weight dequantized in x's dtype, never gated."""
    monkeypatch.setattr(fp8_cpu, "fp8_native_available", lambda: False)
    weight, bias = _random_fp8(128, 40, seed=2), torch.randn(128, dtype=torch.bfloat16)
    layer = Fp8CpuLinear.from_fp8_weight(weight, bias, gated=True)
    assert layer.name == "fp8-torch" and not layer.gated and layer.qweight.dtype == torch.float8_e4m3fn
    x = torch.randn(5, 40, dtype=torch.bfloat16)
    assert layer.silu_and_mul(x) is None
    want = F.linear(x, weight.dequantize().bfloat16(), bias)
    assert torch.equal(layer(x), want)
    assert torch.equal(layer.float_output(x), want.float())


@needs_native_fp8
def test_native_kernel_takes_an_empty_batch() -> None:
    layer = Fp8CpuLinear.from_fp8_weight(_random_fp8(70, 40, seed=0), None)
    assert layer(torch.empty(0, 40, dtype=torch.bfloat16)).shape == (0, 70)
    assert layer.float_output(torch.empty(2, 0, 40, dtype=torch.bfloat16)).shape == (2, 0, 70)


def test_a_bias_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"bias must be \[70\]"):
        Fp8CpuLinear.from_fp8_weight(_random_fp8(70, 40, seed=0), torch.randn(69))
