"""Linear kernels after loading: native/oneDNN-packed bf16 and weight-only int8 (``--quantization int8``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import LLM, EngineArgs, SamplingParams
from pagoda.attention.torch_backend import TorchAttentionBackend
from pagoda.cpu import cpu_ops
from pagoda.layers.cpu_linear import (
    NATIVE_BF16,
    NATIVE_INT8,
    NativeBf16Linear,
    NativeGatedBf16Linear,
    PackedLinear,
    native_linear_support,
    onednn_packing_available,
)
from pagoda.layers.int8_cpu import Int8WeightOnlyLinear, quantize_int8_per_channel
from pagoda.layers.linear import Linear, MergedLinear
from pagoda.layers.linear_kernels import prepare_linear_layers, validate_quantization
from pagoda.loader import load_model

STORY_PROMPTS = [
    f"{start}{tail}"
    for start in ["Once upon a time", "The little dog", "Lily wanted to", "One day, a boy named Tom", "The sun was"]
    for tail in ["", " and", " in the park", " very"]
]


def _dequantized(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.unsqueeze(1)


def test_per_channel_int8_reconstructs_each_weight_within_half_a_step() -> None:
    weight = torch.randn(48, 40) * torch.logspace(-3, 1, 48).unsqueeze(1)  # rows of very different ranges
    weight[5] = 0.0
    q, scales = quantize_int8_per_channel(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (48,)
    assert int(q.abs().max()) == 127  # every non-zero row uses the full range
    error = (_dequantized(q, scales) - weight).abs()
    assert bool((error <= scales.unsqueeze(1) / 2 * (1 + 1e-6)).all())
    assert bool((q[5] == 0).all())


needs_native_int8 = pytest.mark.skipif(
    not cpu_ops() or not native_linear_support(NATIVE_INT8),
    reason="native int8 kernel unavailable (no compiler or no VNNI)",
)
needs_native_bf16 = pytest.mark.skipif(
    not cpu_ops() or not native_linear_support(NATIVE_BF16),
    reason="native bf16 kernel unavailable (no compiler or no BF16)",
)
# odd shapes: neither a multiple of the 64-row tile nor of the k pair; rows straddle the 6-row pass and
# the multi-pass k chunking that starts above 6 rows
ODD_SHAPES = [(37, 83), (64, 64), (130, 600)]
# from 192 bf16 rows the int8 kernel widens tiles to bf16 (200: both sides of that switch)
ROW_COUNTS = [1, 2, 3, 5, 6, 7, 13, 16, 40, 200]


def test_packed_layout_round_trips_every_shape() -> None:
    if not cpu_ops():
        pytest.skip("native CPU kernels could not be built (no compiler)")
    for out_features, in_features in ODD_SHAPES:
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        packed = torch.ops.pagoda_cpu.pack_linear_weight(weight)
        assert packed.shape == (-(-out_features // 64), -(-in_features // 2), 64, 2)
        assert torch.equal(torch.ops.pagoda_cpu.unpack_linear_weight(packed, out_features, in_features), weight)


@needs_native_bf16
@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_native_bf16_kernel_matches_a_float32_product(shape: tuple[int, int], rows: int) -> None:
    torch.manual_seed(rows)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    x = torch.randn(2, rows, in_features, dtype=torch.bfloat16)  # leading dims are kept
    got = NativeBf16Linear.from_weight(weight, bias)(x)
    want = x.float() @ weight.float().T + bias.float()
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, out_features)
    # float32 sums of exact bf16 products: the only error left is the final rounding to bf16
    torch.testing.assert_close(got.float(), want, atol=1e-5 * float(want.abs().max()), rtol=2**-8)


def _plain_and_gated(kind: str, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    if kind == "bf16":
        return NativeBf16Linear.from_weight(weight, bias), NativeGatedBf16Linear.from_weight(weight, bias)
    return Int8WeightOnlyLinear.from_weight(weight, bias), Int8WeightOnlyLinear.from_weight(weight, bias, gated=True)


@needs_native_bf16
@needs_native_int8
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("in_features", [64, 99, 1024])
@pytest.mark.parametrize("rows", [1, 7, 64, 200])  # int8 widens its tiles to bf16 from 192 rows
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_kernels_are_silu_and_mul_over_the_plain_kernels_bit_for_bit(
    kind: str, in_features: int, rows: int, with_bias: bool
) -> None:
    torch.manual_seed(rows + in_features)
    inter = 96
    weight = torch.randn(2 * inter, in_features, dtype=torch.bfloat16)  # [gate | up]
    bias = torch.randn(2 * inter, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    plain, gated = _plain_and_gated(kind, weight, bias)
    assert gated.name.endswith("-gated")
    assert torch.equal(gated.silu_and_mul(x), torch.ops.pagoda_cpu.silu_and_mul(plain(x)))
    # called as a plain linear it still returns [gate | up] in checkpoint order
    assert torch.equal(gated(x), plain(x))
    assert torch.equal(gated.float_output(x), plain.float_output(x))
    assert gated.silu_and_mul(x.view(1, rows, in_features)).shape == (1, rows, inter)


@needs_native_bf16
@needs_native_int8
def test_gated_int8_leaves_other_activation_dtypes_to_the_separate_activation() -> None:
    weight = torch.randn(128, 40)
    gated = Int8WeightOnlyLinear.from_weight(weight, None, gated=True)
    x = torch.randn(3, 40)
    assert gated.silu_and_mul(x) is None  # the epilogue rounds to bf16: float32 rows take silu_and_mul(gated(x))
    assert torch.equal(gated(x), Int8WeightOnlyLinear.from_weight(weight, None)(x))
    assert not Int8WeightOnlyLinear.from_weight(torch.randn(96, 40), None, gated=True).gated  # 48 + 48: no whole tile


@needs_native_bf16
@needs_native_int8
def test_native_kernels_reject_a_bias_of_the_wrong_size() -> None:
    weight, x = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(3, 32, dtype=torch.bfloat16)
    packed = torch.ops.pagoda_cpu.pack_linear_weight(weight)
    short = torch.randn(63, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"bias must be \[64\]"):
        torch.ops.pagoda_cpu.bf16_linear(x, packed, 64, short)
    with pytest.raises(RuntimeError, match=r"bias must be \[64\]"):
        torch.ops.pagoda_cpu.bf16_silu_mul_linear(x, packed, 32, short)
    q, scales = quantize_int8_per_channel(weight)
    packed_q = torch.ops.pagoda_cpu.pack_linear_weight(q)
    with pytest.raises(RuntimeError, match=r"bias must be \[64\]"):
        torch.ops.pagoda_cpu.int8_linear(x, packed_q, scales, 64, short)
    with pytest.raises(RuntimeError, match=r"bias must be \[64\]"):
        torch.ops.pagoda_cpu.int8_silu_mul_linear(x, packed_q, scales, 32, short)


def test_gated_projection_needs_two_equal_parts() -> None:
    assert MergedLinear(8, [32, 32], bias=False, dtype=torch.bfloat16, gated=True).gated
    with pytest.raises(ValueError, match="two equal parts"):
        MergedLinear(8, [32, 16], bias=False, dtype=torch.bfloat16, gated=True)


@needs_native_bf16
@needs_native_int8
def test_native_kernels_take_an_empty_batch() -> None:
    weight = torch.randn(70, 40, dtype=torch.bfloat16)
    for kernel in (NativeBf16Linear.from_weight(weight, None), Int8WeightOnlyLinear.from_weight(weight, None)):
        assert kernel(torch.empty(0, 40, dtype=torch.bfloat16)).shape == (0, 70)
        assert kernel.float_output(torch.empty(2, 0, 40, dtype=torch.bfloat16)).shape == (2, 0, 70)


@needs_native_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_native_int8_kernel_matches_the_dequantized_product(
    dtype: torch.dtype, shape: tuple[int, int], rows: int
) -> None:
    torch.manual_seed(rows)
    out_features, in_features = shape
    q, scales = quantize_int8_per_channel(torch.randn(out_features, in_features))
    bias = torch.randn(out_features).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    packed = torch.ops.pagoda_cpu.pack_linear_weight(q)
    got = torch.ops.pagoda_cpu.int8_linear(x, packed, scales, out_features, bias)
    want = x.float() @ _dequantized(q, scales).T + bias.float()
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 24, 96, 150])  # x holds 2 * rows rows: 192 and up widen bf16 tiles
def test_int8_layer_gives_the_dequantized_product_at_every_batch_size(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(0)
    layer = Int8WeightOnlyLinear.from_weight(torch.randn(64, 96), None)
    x = torch.randn(2, rows, 96).to(dtype)  # leading dims are kept
    want = x.float() @ _dequantized(layer.dense_qweight(), layer.scales).T
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, rows, 64)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol * float(want.abs().max()), rtol=0)


@pytest.mark.skipif(not native_linear_support(NATIVE_INT8), reason="needs the native int8 kernel")
def test_int8_float32_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    """Each float32 row gets its own 16-bit scale and exact integer sums, so a request's result is the same
    alone and in a 300-row batch (before, batches over 48 rows took a dequantized GEMM instead)."""
    torch.manual_seed(3)
    layer = Int8WeightOnlyLinear.from_weight(torch.randn(80, 160), torch.randn(80))
    batch = torch.randn(300, 160)
    together = layer(batch)
    for row in (0, 47, 48, 299):
        assert torch.equal(layer(batch[row : row + 1]), together[row : row + 1])


def _kernels_for_float_output(dtype: torch.dtype) -> list:
    torch.manual_seed(1)
    weight, bias = torch.randn(130, 600, dtype=dtype), torch.randn(130, dtype=dtype)
    kernels: list = [Int8WeightOnlyLinear.from_weight(weight, bias)]
    if dtype == torch.bfloat16 and native_linear_support(NATIVE_BF16):
        kernels.append(NativeBf16Linear.from_weight(weight, bias))
    if onednn_packing_available(dtype):
        kernels.append(PackedLinear.from_weight(weight, bias))
    return kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 16, 40, 144])
def test_float_output_equals_the_output_widened_to_float32(dtype: torch.dtype, rows: int) -> None:
    """Logits: every kernel's one-pass float32 output is exactly ``kernel(x).float()`` (HF rounds them too)."""
    x = torch.randn(2, rows, 600).to(dtype)
    for kernel in _kernels_for_float_output(dtype):
        got = kernel.float_output(x)
        assert got.dtype == torch.float32 and got.shape == (2, rows, 130), kernel.name
        assert torch.equal(got, kernel(x).float()), kernel.name


def test_linear_layer_float32_forward_with_and_without_a_kernel() -> None:
    torch.manual_seed(2)
    layer = Linear(96, 40, bias=False, dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(40, 96))
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    plain = layer.forward_float32(x)
    assert plain.dtype == torch.float32 and torch.equal(plain, F.linear(x, layer.weight).float())
    layer.set_kernel(Int8WeightOnlyLinear.from_weight(layer.weight, None))
    assert torch.equal(layer.forward_float32(x), layer(x).float())


@pytest.mark.skipif(not onednn_packing_available(torch.bfloat16), reason="oneDNN bf16 is not available here")
def test_packed_bf16_linear_is_bit_identical_to_f_linear() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 288, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    packed = PackedLinear.from_weight(weight, bias)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 288, dtype=torch.bfloat16)
        assert torch.equal(packed(x), F.linear(x, weight, bias))


def test_prepare_packs_bf16_keeps_fp32_on_torch_and_quantizes_everything_for_int8(tiny) -> None:
    model_dir = tiny.get("qwen3")
    fp32 = load_model(model_dir, TorchAttentionBackend(), torch.float32)
    assert prepare_linear_layers(fp32, torch.device("cpu"), torch.float32, None) == {"torch-linear": 1 + 2 * 4}
    bf16 = load_model(model_dir, TorchAttentionBackend(), torch.bfloat16)
    counts = prepare_linear_layers(bf16, torch.device("cpu"), torch.bfloat16, None)
    if native_linear_support(NATIVE_BF16):
        assert counts == {"native-bf16": 7, "native-bf16-gated": 2}  # gate_up of both layers: SiLU in the epilogue
    elif onednn_packing_available(torch.bfloat16):
        assert counts == {"onednn-packed": 9}
    int8 = load_model(model_dir, TorchAttentionBackend(), torch.float32)
    assert prepare_linear_layers(int8, torch.device("cpu"), torch.float32, "int8") == {"int8-weight-only": 9}
    if native_linear_support(NATIVE_BF16) and native_linear_support(NATIVE_INT8):
        int8_bf16 = load_model(model_dir, TorchAttentionBackend(), torch.bfloat16)
        counts = prepare_linear_layers(int8_bf16, torch.device("cpu"), torch.bfloat16, "int8")
        assert counts == {"int8-weight-only": 7, "int8-weight-only-gated": 2}
    linear = next(m for m in int8.modules() if isinstance(m, Linear))
    assert linear.weight.numel() == 0  # the plain weight is released once quantized


def test_quantization_is_validated_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not supported.*awq, gptq, fp8, int8"):
        EngineArgs(quantization="bitsandbytes").validate()
    with pytest.raises(ValueError, match="runs on cpu only, not cuda"):
        validate_quantization("int8", torch.device("cuda"))
    validate_quantization(None, torch.device("cuda"))


def test_int8_stories260k_keeps_greedy_output_and_logits_close() -> None:
    """stories260K in fp32: int8 weights against the unquantized model on 20 prompts x 32 tokens.

    The model has a hidden size of 64, so near-ties exist: casting the same model to bf16 (no
    quantization) already changes 5 of these 20 outputs. int8 must do at least as well: at least
    15 of 20 identical and 85% of all tokens identical (measured: 17 of 20, 92%).
    """
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    base = LLM(enable_prefix_caching=False).generate(STORY_PROMPTS, params, use_tqdm=False)
    int8 = LLM(enable_prefix_caching=False, quantization="int8").generate(STORY_PROMPTS, params, use_tqdm=False)
    pairs = [(a.outputs[0].token_ids, b.outputs[0].token_ids) for a, b in zip(base, int8)]
    identical = sum(a == b for a, b in pairs)
    token_agreement = sum(x == y for a, b in pairs for x, y in zip(a, b)) / sum(len(a) for a, _ in pairs)
    assert identical >= 15, identical
    assert token_agreement >= 0.85, token_agreement
    # prompt logprobs are the same positions scored by both models: their log-likelihoods stay close
    for a, b in zip(base, int8):
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (token,) = set(pa) & set(pb)
            assert abs(pa[token].logprob - pb[token].logprob) < 0.25
