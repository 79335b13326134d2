"""Tile configurations of the weight-quantized GEMM (:mod:`pagoda_kernels.quant_gemm`), chosen from the shapes alone.

No autotuning: an autotuner times its candidates on the first call, which a CUDA-graph capture cannot contain.

* decode (M <= 16): one 16-row tile, 128-deep K tiles. Layers of a small model have few column tiles (N=1024 in
  64-column tiles is 16 programs on a 132-SM GPU), so K is split across programs until there are about two per
  SM (:func:`gemm_config`), each writing float32 partial sums that the split-K reduction adds in a fixed order
  (deterministic, unlike atomics). The split is capped so the partials stay small next to the weight.
* 16 < M <= 64: 32- or 64-row tiles, split the same way when the grid is small.
* prefill: 64x128 or 128x128 tiles, 64 deep, 8 warps for the larger one; no split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from pagoda_kernels.host import dot_precision, sm_count

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


def tiles_for(device: torch.device, m: int) -> GemmConfig:
    """The tiles for ``m`` rows on ``device``, before :func:`gemm_config` fits them to the problem."""
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
    cfg = tiles_for(device, m)
    block_k = cfg.block_k
    if k_granule > 0 and k_granule % block_k != 0:
        fitting = [b for b in (16, 32, 64, 128) if b <= block_k and k_granule % b == 0]
        block_k = fitting[-1] if fitting else block_k
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(n)))
    split = 1
    if m <= 64:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, block_n)
        programs = PROGRAMS_PER_SM * (sm_count(device) if device.type == "cuda" else 2)
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
    return {"DOT_PRECISION": "ieee" if interpreted else dot_precision(x.dtype), "UPCAST_DOT": interpreted}
