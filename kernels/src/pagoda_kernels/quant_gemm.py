"""Shared pieces of the weight-quantized GEMMs (:mod:`pagoda_kernels.int_gemm`, :mod:`pagoda_kernels.fp8_gemm`):
tile configurations, the epilogue, and the split-K reduction.

Every GEMM here computes ``y[M, N] = x[M, K] @ W^T`` with W dequantized tile by tile inside the kernel (never a
dense copy), accumulates in float32 and rounds once to x's dtype. A launch reads only shapes on the host, so
it never syncs with the device and can be captured in a CUDA graph (the split-K workspace is sized by shapes).

Tiles are chosen from the shapes alone (no autotuning: an autotuner times its candidates on the first call, which
a CUDA-graph capture cannot contain):

* decode (M <= 16): one 16-row tile, 128-deep K tiles. Layers of a small model have few column tiles (N=1024 in
  64-column tiles is 16 programs on a 132-SM GPU), so K is split across programs until there are about two per
  SM (:func:`gemm_config`), each writing float32 partial sums that :func:`_splitk_reduce_kernel` adds in a fixed
  order (deterministic, unlike atomics). The split is capped so the partials stay small next to the weight.
* 16 < M <= 64: 32- or 64-row tiles, split the same way when the grid is small.
* prefill: 64x128 or 128x128 tiles, 64 deep, 8 warps for the larger one; no split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SPLIT_WORKSPACE_RATIO = 0.5  # partial sums may add at most half the weight's bytes of traffic
PROGRAMS_PER_SM = 2  # split K until the grid has about this many programs per SM


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tile sizes and launch parameters of one GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # programs along K; > 1 writes float32 partials reduced by a second kernel
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tiles(device: torch.device, m: int) -> GemmConfig:
    if device.type != "cuda":
        # Triton's interpreter: small tiles keep numpy's work small and make test shapes span several tiles.
        return GemmConfig(16, 32, 32, num_warps=1, num_stages=1)
    if m <= 16:
        return GemmConfig(16, 64, 128, num_warps=4, num_stages=4)
    if m <= 64:
        return GemmConfig(32 if m <= 32 else 64, 64, 64, num_warps=4, num_stages=4)
    if m <= 128:
        return GemmConfig(64, 128, 64, num_warps=4, num_stages=3)
    return GemmConfig(128, 128, 64, num_warps=8, num_stages=3)


def gemm_config(device: torch.device, m: int, n: int, k: int, weight_bits: int, k_granule: int = 0) -> GemmConfig:
    """The configuration for an [m, k] x [k, n] GEMM on ``device`` with ``weight_bits``-bit weights.

    ``k_granule`` > 0: K tiles must not straddle a multiple of it (a quantization group): the K tile is shrunk to
    the largest power of two >= 16 dividing it, when one exists (otherwise the kernel gathers per-row scales).
    """
    cfg = _tiles(device, m)
    block_k = cfg.block_k
    if k_granule > 0 and k_granule % block_k != 0:
        fitting = [b for b in (16, 32, 64, 128) if b <= block_k and k_granule % b == 0]
        block_k = fitting[-1] if fitting else block_k
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(n)))
    split = 1
    if m <= 64:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, block_n)
        programs = PROGRAMS_PER_SM * (_sm_count(device) if device.type == "cuda" else 2)
        # partials: split * m * n * 4 bytes against the weight's n * k * bits / 8
        by_traffic = int(SPLIT_WORKSPACE_RATIO * k * weight_bits / (32 * m))
        split = max(1, min(triton.cdiv(programs, tiles), triton.cdiv(k, block_k), by_traffic))
    return GemmConfig(cfg.block_m, block_n, block_k, split, cfg.num_warps, cfg.num_stages)


def split_bounds(k: int, cfg: GemmConfig) -> tuple[int, int]:
    """(K columns per split, number of non-empty splits): each split covers whole K tiles."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(k_tiles, cfg.split_k) * cfg.block_k
    return per_split, triton.cdiv(k, per_split)


def dot_options(x: torch.Tensor) -> dict:
    """Kernel keywords for the dot of ``x``'s dtype: exact fp32 products for fp32 models; in the interpreter the
    16-bit tiles are multiplied as fp32 copies (it would multiply bf16 tiles as their raw bits), which gives the
    same exact products a GPU's 16-bit dot accumulates in fp32."""
    interpreted = x.device.type != "cuda"
    precision = "ieee" if x.dtype == torch.float32 or interpreted else "tf32"
    return {"DOT_PRECISION": precision, "UPCAST_DOT": interpreted}


@triton.jit
def store_output(
    acc,  # [BLOCK_M, BLOCK_N] float32 sums
    rows,  # [BLOCK_M] int64
    cols,  # [BLOCK_N] int32
    M,
    N,
    out_ptr,  # [M, N], unit last stride
    stride_om,
    col_scale_ptr,  # [N] float32 (HAS_COL_SCALE)
    bias_ptr,  # [N] (HAS_BIAS)
    HAS_COL_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,  # the activation dtype: a float32 output is rounded through it first
):
    """The epilogue: ``acc * col_scale[n] + bias[n]`` in float32, rounded once to the activation dtype."""
    col_valid = cols < N
    if HAS_COL_SCALE:
        acc = acc * tl.load(col_scale_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out = acc.to(ROUND_DTYPE).to(out_ptr.dtype.element_ty)  # float_output: rounded to x's dtype, then widened
    mask = (rows < M)[:, None] & col_valid[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=mask)


@triton.jit
def store_partial(acc, rows, cols, M, N, ws_ptr):
    """Split-K: this split's float32 sums into its [M, N] slice of the workspace (program axis 2 = split)."""
    ws = ws_ptr + tl.program_id(2).to(tl.int64) * M * N
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(ws + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr,  # [SPLIT, M, N] float32 partial sums
    out_ptr,  # [M, N], unit last stride
    col_scale_ptr,
    bias_ptr,
    M,
    N,
    SPLIT,
    stride_om,
    HAS_COL_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None] * N + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(SPLIT):  # a fixed order: the result does not depend on scheduling
        acc += tl.load(ws_ptr + (s * M).to(tl.int64) * N + offs, mask=mask, other=0.0)
    store_output(
        acc, rows, cols, M, N, out_ptr, stride_om, col_scale_ptr, bias_ptr, HAS_COL_SCALE, HAS_BIAS, ROUND_DTYPE
    )


def splitk_reduce(ws: torch.Tensor, out: torch.Tensor, col_scale, bias, round_dtype: tl.dtype) -> None:
    """out = (sum over splits of ws) * col_scale + bias, rounded as :func:`store_output` does."""
    split, m, n = ws.shape
    block_m, block_n = min(16, triton.next_power_of_2(m)), 128 if ws.device.type == "cuda" else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _splitk_reduce_kernel[grid](
        ws,
        out,
        col_scale if col_scale is not None else ws,
        bias if bias is not None else ws,
        m,
        n,
        split,
        out.stride(0),
        HAS_COL_SCALE=col_scale is not None,
        HAS_BIAS=bias is not None,
        ROUND_DTYPE=round_dtype,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4 if ws.device.type == "cuda" else 1,
    )


TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def check_activation(x: torch.Tensor, in_features: int, device: torch.device) -> None:
    """x must be [..., in_features] in a float dtype the kernels take, on the weight's device."""
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., {in_features}], got {tuple(x.shape)}")
    if x.dtype not in TL_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"x is on {x.device}, the weight on {device}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [M, K] with unit last stride (a view when one exists)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
