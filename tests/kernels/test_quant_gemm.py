"""Weight-quantized GEMMs (int4/int8 group-wise, FP8 e4m3) against their torch references, and the engine's GPU
linear layers built on them.

Without a GPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1), whose tiles are 16
rows, 32 columns and 32 deep: the shapes below are ragged against them (N=72, K=100), and decode row counts take
the split-K path (2 splits) while 17+ rows do not. bf16 tolerances are loose because the interpreter truncates
float32 -> bf16 where a GPU rounds to nearest. Outputs and split-K workspaces come from ``torch.empty``, poisoned
with NaN (tests/kernels/conftest.py), so an element a kernel never writes shows up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

import pytest
import torch

from pagoda.layers.quant_gpu import Fp8GpuLinear, TritonIntLinear, fp8_scaled_mm_supported
from pagoda.quantization.weights import Fp8Weight, IntWeight, quantize_fp8_per_row
from pagoda_kernels.fp8_gemm import (
    fp8_scaled_mm,
    fp8_scaled_mm_reference,
    fp8_w8a16_gemm,
    fp8_w8a16_reference,
    quantize_fp8_rows,
    quantize_fp8_rows_reference,
    rowwise_out_dtype,
)
from pagoda_kernels.gemm_tiles import GemmConfig
from pagoda_kernels.int_gemm import int_gemm, int_gemm_reference, pack_int_weight, unpack_qweight

pytestmark = pytest.mark.usefixtures("poisoned_allocations")

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
N = 72  # output features: 2.25 interpreter column tiles
# (in_features, group_size): 32/64/128-wide groups, and one group over a whole K that is no multiple of 8 or 32
GROUPS = [(96, 32), (192, 64), (256, 128), (100, 100)]
FINITE_E4M3 = [b for b in range(256) if b & 0x7F != 0x7F]  # every byte but the two NaN codes


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int_weight(n: int, k: int, group: int, bits: int, perm: bool, seed: int = 0, fp16_scales: bool = True):
    """A random asymmetric IntWeight scaled so that outputs are O(1); float16-exact scales, as checkpoints have."""
    gen, groups = _gen(seed), k // group
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=gen) + 0.5) / (2**bits * k**0.5)
    scales = scales.half().float() if fp16_scales else scales
    order = torch.randperm(k, generator=gen) if perm else None
    return IntWeight(q, scales, zeros, group, bits, order)


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=_gen(seed)).to(dtype)


def _bias(n: int, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, generator=_gen(seed)).to(dtype)


def _packed(w: IntWeight):
    return pack_int_weight(w.qweight, w.scales, w.zeros, w.group_size, w.bits, w.perm)


@pytest.mark.parametrize("perm", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize(("k", "group"), GROUPS)
@pytest.mark.parametrize("bits", [4, 8])
def test_int_gemm_matches_reference(bits: int, k: int, group: int, perm: bool) -> None:
    w = _int_weight(N, k, group, bits, perm, seed=bits + k)
    x, bias = _x(3, k, torch.float16), _bias(N, torch.float16)
    y = int_gemm(x, _packed(w), bias)
    assert y.shape == (3, N) and y.dtype == torch.float16
    torch.testing.assert_close(y, int_gemm_reference(x, w, bias), **TOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_int_gemm_row_counts(m: int, dtype: torch.dtype) -> None:
    w = _int_weight(40, 192, 64, 4, perm=True, seed=m)
    x = _x(m, 192, dtype)
    torch.testing.assert_close(int_gemm(x, _packed(w)), int_gemm_reference(x, w), **TOL[dtype])


def test_int_gemm_many_rows() -> None:
    w = _int_weight(24, 64, 32, 4, perm=False)
    x, bias = _x(300, 64, torch.bfloat16), _bias(24, torch.bfloat16)
    torch.testing.assert_close(int_gemm(x, _packed(w), bias), int_gemm_reference(x, w, bias), **TOL[torch.bfloat16])


@pytest.mark.parametrize(
    ("group", "config"),
    [
        (32, GemmConfig(16, 32, 32, split_k=3)),  # K tiles inside a group, 3 splits reduced in order
        (32, GemmConfig(16, 32, 64, split_k=1)),  # 64-deep tiles over 32-wide groups: per-row scales gathered
        (64, GemmConfig(32, 16, 128, split_k=2)),  # gathered, and split
        (48, GemmConfig(16, 32, 32, split_k=1)),  # groups that K tiles straddle
    ],
    ids=["split3", "gathered-scales", "gathered-split2", "straddled-groups"],
)
def test_int_gemm_tile_paths(group: int, config: GemmConfig) -> None:
    """float32 activations: exact products, so every tiling agrees with the reference up to summation order."""
    w = _int_weight(N, 192, group, 4, perm=True, seed=group)
    x, bias = _x(5, 192, torch.float32), _bias(N, torch.float32)
    y = int_gemm(x, _packed(w), bias, config=config)
    torch.testing.assert_close(y, int_gemm_reference(x, w, bias), **TOL[torch.float32])


def test_int_float_output_is_rounded_output() -> None:
    """float_output is self(x).float(): rounded to x's dtype first, on the split and the unsplit path."""
    w = _int_weight(N, 96, 32, 4, perm=False)
    packed, bias = _packed(w), _bias(N, torch.bfloat16)
    for m in (2, 17):
        x = _x(m, 96, torch.bfloat16)
        y32 = int_gemm(x, packed, bias, float_output=True)
        assert y32.dtype == torch.float32
        assert torch.equal(y32, int_gemm(x, packed, bias).float())


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trip_and_scale_storage(bits: int) -> None:
    w = _int_weight(N, 100, 100, bits, perm=True)
    packed = _packed(w)
    assert packed.qweight.dtype == torch.int32 and packed.qweight.shape == ((100 + 32 // bits - 1) // (32 // bits), N)
    assert torch.equal(unpack_qweight(packed), w.qweight)
    assert packed.scales.dtype == torch.float16  # float16-exact scales are stored in 16 bits
    assert torch.equal(packed.perm.long(), w.perm)
    inexact = _int_weight(N, 100, 100, bits, perm=False, fp16_scales=False)
    assert _packed(inexact).scales.dtype == torch.float32


def test_int_gemm_inexact_scales_stay_float32() -> None:
    w = _int_weight(N, 96, 32, 4, perm=False, fp16_scales=False)
    x = _x(3, 96, torch.float32)
    torch.testing.assert_close(int_gemm(x, _packed(w)), int_gemm_reference(x, w), **TOL[torch.float32])


def test_int_gemm_rejects_bad_inputs() -> None:
    packed = _packed(_int_weight(N, 96, 32, 4, perm=False))
    with pytest.raises(ValueError, match="x must be"):
        int_gemm(torch.zeros(2, 95), packed)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        int_gemm(torch.zeros(2, 96, dtype=torch.int32), packed)
    with pytest.raises(ValueError, match="bias"):
        int_gemm(torch.zeros(2, 96), packed, torch.zeros(N + 1))
    with pytest.raises(ValueError, match="group_size"):
        pack_int_weight(torch.zeros(4, 96, dtype=torch.uint8), torch.zeros(3, 4), torch.zeros(3, 4), 40, 4)


def _e4m3(codes: list[int], shape: tuple[int, int]) -> torch.Tensor:
    return torch.tensor(codes, dtype=torch.uint8).view(shape).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_w8a16_widens_every_e4m3_value_exactly(dtype: torch.dtype) -> None:
    """An identity x reads the weight back: y = I @ W^T = W^T, exact for all 254 finite e4m3 values (every one is
    a float16 and a bfloat16 value), subnormals and both zeros included, in 127-row tiles ragged against 32."""
    q = _e4m3(FINITE_E4M3, (2, 127))
    y = fp8_w8a16_gemm(torch.eye(127, dtype=dtype), q, torch.ones(2))
    assert torch.equal(y.float(), q.float().T)
    assert torch.equal(torch.signbit(y[:, 0]), torch.signbit(q.float()[0]))  # -0.0 stays negative
    split = fp8_w8a16_gemm(torch.eye(127, dtype=dtype)[:5], q, torch.ones(2), config=GemmConfig(16, 16, 32, 2))
    assert torch.equal(split.float(), q.float().T[:5])


def test_w8a16_nan_codes_give_nan() -> None:
    q = _e4m3([0x7F] + [0x38] * 15 + [0xFF] + [0x38] * 15, (2, 16))  # 0x38 is 1.0
    y = fp8_w8a16_gemm(torch.ones(1, 16, dtype=torch.float16), q, torch.ones(2))
    assert y.isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 17])
def test_w8a16_matches_reference(m: int, dtype: torch.dtype) -> None:
    w = quantize_fp8_per_row(torch.randn(N, 100, generator=_gen(m)) / 10)
    x, bias = _x(m, 100, dtype), _bias(N, dtype)
    y = fp8_w8a16_gemm(x, w.qweight, w.scales, bias)
    torch.testing.assert_close(y, fp8_w8a16_reference(x, w.qweight, w.scales, bias), **TOL[dtype])
    assert torch.equal(fp8_w8a16_gemm(x, w.qweight, w.scales, bias, float_output=True), y.float())


def test_quantize_rows_indexing_and_scales() -> None:
    """Values that need no rounding come back exactly (the interpreter's float32 -> e4m3 conversion rounds some
    values wrongly across a power of two; on a GPU the hardware converts): dynamic per-row scales from the row's
    maximum, and a static scale with values past the e4m3 range clamped to +-448."""
    codes = _e4m3(FINITE_E4M3[:250], (5, 50)).float()
    codes[:, 7] = torch.tensor([448.0, -448.0, 448.0, -448.0, 448.0])  # every row's max |value| is 448
    row_scales = torch.tensor([[2.0**-3], [1.0], [2.0**4], [2.0**-9], [0.5]])
    x = (codes * row_scales).to(torch.bfloat16)
    q, scales = quantize_fp8_rows(x)
    assert torch.equal(scales, row_scales) and torch.equal(q.float(), codes)
    static = torch.tensor([0.25])
    x2 = (codes * 0.25).to(torch.bfloat16)
    x2[0, 0], x2[1, 1] = 1000.0, -1000.0
    q2, scales2 = quantize_fp8_rows(x2, static)
    ref_q2, ref_scales2 = quantize_fp8_rows_reference(x2, static)
    assert torch.equal(scales2, ref_scales2) and torch.equal(q2.float(), ref_q2.float())
    assert q2.float()[0, 0] == 448.0 and q2.float()[1, 1] == -448.0


@pytest.mark.parametrize("rowwise", [True, False], ids=["rowwise", "unit-scales"])
@pytest.mark.parametrize("input_scale", [None, 2.0**-6], ids=["per-token", "static"])
def test_fp8_scaled_mm_on_cpu(input_scale: Optional[float], rowwise: bool) -> None:
    """The scaled_mm path through torch's CPU ``_scaled_mm``, with activations that quantize exactly (each row's
    maximum is 448 * 2**-6), so the interpreter's conversion cannot differ; also as the engine layer calls it."""
    gen = _gen(7)
    w = quantize_fp8_per_row(torch.randn(64, 96, generator=gen) / 10)
    codes = _e4m3(FINITE_E4M3, (2, 127)).float().flatten()[torch.randint(0, 254, (5, 96), generator=gen)]
    codes[:, 3] = 448.0
    x, bias = (codes * 2.0**-6).to(torch.bfloat16), _bias(64, torch.bfloat16)
    scale = None if input_scale is None else torch.tensor([input_scale])
    ref = fp8_scaled_mm_reference(x, w.qweight, w.scales, scale, bias)
    torch.testing.assert_close(fp8_scaled_mm(x, w.qweight, w.scales, scale, bias, rowwise), ref, rtol=0, atol=0)
    rowwise_dtypes = frozenset([torch.bfloat16] if rowwise else [])
    layer = Fp8GpuLinear(w.qweight, w.scales, scale, bias, rowwise_dtypes, "fp8-scaled-mm", fp8_scaled_mm)
    torch.testing.assert_close(layer(x[None]), ref[None], rtol=0, atol=0)
    assert torch.equal(layer.float_output(x), ref.float())


@pytest.mark.parametrize(
    ("approved", "with_bias", "rowwise"),
    [
        ({torch.bfloat16}, True, False),  # the GEMM asks for float32 when a bias follows: bf16 approval is not enough
        ({torch.bfloat16, torch.float32}, True, True),
        ({torch.float32}, False, False),
        ({torch.bfloat16}, False, True),
    ],
)
def test_fp8_scaled_mm_goes_row_wise_only_into_an_output_dtype_the_probe_approved(
    approved: set[torch.dtype], with_bias: bool, rowwise: bool
) -> None:
    """Fp8GpuLinear's choice, with the probe's answer given (no FP8 GPU here): row-wise scaling only where the load
    time probe saw ``torch._scaled_mm`` take it into the very out_dtype the call will ask for."""
    w = quantize_fp8_per_row(torch.randn(32, 32, generator=_gen(8)))
    bias = _bias(32, torch.bfloat16) if with_bias else None
    calls: list[bool] = []

    def gemm(x, qweight, scales, input_scale, bias, rowwise):  # stands in for the FP8 tensor cores
        calls.append(rowwise)
        return fp8_scaled_mm(x, qweight, scales, input_scale, bias, rowwise)

    layer = Fp8GpuLinear(w.qweight, w.scales, None, bias, frozenset(approved), "fp8-scaled-mm", gemm)
    layer(_x(2, 32, torch.bfloat16))
    assert calls == [rowwise]


def test_triton_int_linear_matches_reference() -> None:
    w = _int_weight(N, 192, 64, 4, perm=True)
    bias = _bias(N, torch.bfloat16)
    layer = TritonIntLinear.from_int_weight(w, bias)
    assert layer.name == "int4-triton"
    assert TritonIntLinear.from_int_weight(_int_weight(N, 96, 32, 8, perm=False), None).name == "int8-triton"
    x = torch.randn(2, 3, 192, generator=_gen(3)).to(torch.bfloat16)  # leading dimensions are kept
    y = layer(x)
    assert y.shape == (2, 3, N)
    torch.testing.assert_close(y, int_gemm_reference(x, w, bias), **TOL[torch.bfloat16])
    assert torch.equal(layer.float_output(x), y.float())


def test_fp8_gpu_linear_without_fp8_tensor_cores_is_w8a16() -> None:
    w = quantize_fp8_per_row(torch.randn(N, 100, generator=_gen(4)) / 10)
    bias = _bias(N, torch.float16)
    assert not fp8_scaled_mm_supported(torch.device("cpu"))
    layer = Fp8GpuLinear.from_fp8_weight(w, bias)
    assert layer.name == "fp8-triton-w8a16"
    x = _x(3, 100, torch.float16)
    y = layer(x)
    torch.testing.assert_close(y, fp8_w8a16_reference(x, w.qweight, w.scales, bias), **TOL[torch.float16])
    assert torch.equal(layer.float_output(x), y.float())


# --- on a GPU -----------------------------------------------------------------------------------------------------


def _cuda_fp8_weight(n: int, k: int, input_scale: Optional[float] = None) -> Fp8Weight:
    w = quantize_fp8_per_row(torch.randn(n, k, generator=_gen(n + k)) / k**0.5)
    scale = None if input_scale is None else torch.tensor(input_scale)
    return Fp8Weight(w.qweight.cuda(), w.scales.cuda(), None if scale is None else scale.cuda())


def _codes_agree(q: torch.Tensor, ref: torch.Tensor) -> None:
    """e4m3 codes equal the reference's except for a few one-step differences (sm_89 converts float32 -> float16
    -> e4m3, rounding twice)."""
    a, b = q.view(torch.uint8).int(), ref.view(torch.uint8).int()
    assert (a - b).abs().max() <= 1 and (a != b).float().mean() < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_quantize_rows_on_gpu(static: bool) -> None:
    x = torch.randn(33, 4000, generator=_gen(6)).to(torch.bfloat16).cuda() * 3
    scale = torch.tensor([0.02], device="cuda") if static else None
    q, scales = quantize_fp8_rows(x, scale)
    ref_q, ref_scales = quantize_fp8_rows_reference(x, scale)
    assert torch.equal(scales, ref_scales)
    _codes_agree(q, ref_q)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_quant_gemms_on_gpu(m: int, dtype: torch.dtype) -> None:
    """Compiled kernels (decode, split-K and prefill tiles) against the references, on ragged shapes."""
    w = _int_weight(1000, 1024, 128, 4, perm=True)
    w = IntWeight(w.qweight.cuda(), w.scales.cuda(), w.zeros.cuda(), 128, 4, w.perm.cuda())
    x, bias = _x(m, 1024, dtype).cuda(), _bias(1000, dtype).cuda()
    torch.testing.assert_close(int_gemm(x, _packed(w), bias), int_gemm_reference(x, w, bias), **TOL[dtype])
    f = _cuda_fp8_weight(1000, 1000)
    x8 = _x(m, 1000, dtype).cuda()
    y = fp8_w8a16_gemm(x8, f.qweight, f.scales, bias)
    torch.testing.assert_close(y, fp8_w8a16_reference(x8, f.qweight, f.scales, bias), **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("rowwise", [True, False], ids=["rowwise", "unit-scales"])
@pytest.mark.parametrize("input_scale", [None, 0.01], ids=["per-token", "static"])
def test_fp8_scaled_mm_matches_reference(input_scale: Optional[float], rowwise: bool) -> None:
    if not fp8_scaled_mm_supported(torch.device("cuda")):
        pytest.skip("no FP8 tensor cores (compute capability < 8.9)")
    from pagoda_kernels.fp8_gemm import rowwise_scaled_mm_supported

    if rowwise and not rowwise_scaled_mm_supported(torch.device("cuda"), rowwise_out_dtype(torch.bfloat16, True)):
        pytest.skip("this torch build has no row-wise _scaled_mm into float32")
    w = _cuda_fp8_weight(2048, 1024, input_scale)
    x, bias = _x(37, 1024, torch.bfloat16).cuda(), _bias(2048, torch.bfloat16).cuda()
    y = fp8_scaled_mm(x, w.qweight, w.scales, w.input_scale, bias, rowwise)
    ref = fp8_scaled_mm_reference(x, w.qweight, w.scales, w.input_scale, bias)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)  # a few activation codes may round one step apart


@pytest.mark.gpu
def test_gpu_layers_replay_in_cuda_graphs() -> None:
    """Both layers capture into a CUDA graph (no syncs, shape-only allocations) and replay what eager computes."""
    w = _int_weight(1024, 1024, 128, 4, perm=True)
    w = IntWeight(w.qweight.cuda(), w.scales.cuda(), w.zeros.cuda(), 128, 4, w.perm.cuda())
    layers = [
        TritonIntLinear.from_int_weight(w, None),
        Fp8GpuLinear.from_fp8_weight(_cuda_fp8_weight(1024, 1024), None),
    ]
    x = _x(8, 1024, torch.bfloat16).cuda()
    for layer in layers:
        eager = layer(x)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), layer.name


# Compiles each kernel as the GPU configurations launch it, for sm_90 (H100/H200) and sm_80 (A100: the Triton
# paths are the only ones there), through PTX to cubin with the ptxas Triton ships. Runs in a subprocess without
# TRITON_INTERPRET (kernels decorated under the interpreter cannot be compiled).
def _build(fn, signature: dict, consts: dict, capability: int, cfg: Optional[GemmConfig] = None) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=signature | dict.fromkeys(consts, "constexpr"), constexprs=consts)
    options = {} if cfg is None else dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def compile_for_gpus() -> None:
    """Compile the GEMM kernel for both weight formats at decode, medium and prefill tiles, the reduction and the
    activation quantizer."""
    import triton.language as tl

    from pagoda_kernels import fp8_gemm, gemm_tiles, quant_gemm
    from pagoda_kernels.weight_tiles import FP8_WEIGHT, INT_WEIGHT

    ints = dict.fromkeys(["M", "N", "K", "group_size", "k_per_split", "stride_xm", "stride_om"], "i32")
    dot = dict(DOT_PRECISION="tf32", UPCAST_DOT=False)
    gemm = quant_gemm._quant_gemm_kernel
    for cap in (90, 80):
        for m, bits, split, tile_group, perm in [
            (1, 4, True, True, False),
            (4096, 4, False, False, True),
            (48, 8, 0, 1, 0),
        ]:
            cfg = gemm_tiles.tiles_for(torch.device("cuda"), m)
            sig = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*fp16", z_ptr="*u8", perm_ptr="*i32", bias_ptr="*bf16")
            sig |= dict(out_ptr="*fp32" if split else "*bf16", **ints)
            consts = dict(FORMAT=INT_WEIGHT, BITS=bits, HAS_PERM=bool(perm), HAS_BIAS=True, SPLIT=bool(split))
            consts |= dict(TILE_GROUP=bool(tile_group), ROUND_DTYPE=tl.bfloat16, BLOCK_M=cfg.block_m)
            _build(gemm, sig, consts | dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **dot), cap, cfg)
        for m, split in [(1, True), (4096, False)]:
            cfg = gemm_tiles.tiles_for(torch.device("cuda"), m)
            sig = dict(x_ptr="*fp16", w_ptr="*u8", s_ptr="*fp32", z_ptr="*u8", perm_ptr="*u8", bias_ptr="*fp16", **ints)
            sig["out_ptr"] = "*fp32" if split else "*fp16"
            consts = dict(FORMAT=FP8_WEIGHT, BITS=8, HAS_PERM=False, HAS_BIAS=True, SPLIT=split, TILE_GROUP=True)
            consts |= dict(ROUND_DTYPE=tl.float16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
            _build(gemm, sig, consts | dot, cap, cfg)
        sig = dict(ws_ptr="*fp32", out_ptr="*fp32", col_scale_ptr="*fp32", bias_ptr="*bf16", stride_om="i32")
        sig |= dict.fromkeys(["M", "N", "SPLIT"], "i32")
        consts = dict(HAS_COL_SCALE=True, HAS_BIAS=True, ROUND_DTYPE=tl.bfloat16, BLOCK_M=16, BLOCK_N=128)
        _build(quant_gemm._splitk_reduce_kernel, sig, consts, cap)
    sig = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32", static_ptr="*fp32", K="i32", stride_xm="i32")
    _build(fp8_gemm._quantize_fp8_rows_kernel, sig, dict(STATIC=False, BLOCK=4096), 90)


@pytest.mark.slow
def test_kernels_compile_for_gpus() -> None:
    """Lowering errors the interpreter cannot show (layouts, dot shapes, conversions) fail here without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    load = "import importlib.util as u, sys; s = u.spec_from_file_location('m', sys.argv[1]); m = u.module_from_spec(s)"
    script = f"{load}; s.loader.exec_module(m); m.compile_for_gpus(); print('compiled')"
    proc = subprocess.run(
        [sys.executable, "-c", script, __file__], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
