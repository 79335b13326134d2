"""SwiGLU gate: silu(gate) * up over a fused [gate | up] projection, as a Triton kernel and in torch.

Rounding follows the unfused torch expression ``F.silu(gate) * up``: silu is computed in float32 and
rounded to the activation dtype, then multiplied by ``up`` in float32 and rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagoda_kernels.host import unit_last_stride

_BLOCK = 1024  # most elements of one row per program


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * inter], unit stride along the last dimension
    out_ptr,  # [num_rows, inter] contiguous
    inter,
    x_stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride_row + inter + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    # Same formula as torch's silu; rounded to the activation dtype before the multiply, as F.silu is.
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(x: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x must be [..., 2 * intermediate] laid out [gate | up], got {tuple(x.shape)}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x: [..., 2 * inter] = [gate | up] -> new [..., inter] in x.dtype.

    Rows may be strided (a slice of a wider tensor); the last dimension is made contiguous if it is not.
    """
    _check_args(x)
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = unit_last_stride(x.reshape(-1, x.shape[-1]))  # [num_rows, 2 * inter]; a view whenever one exists
    block = min(_BLOCK, triton.next_power_of_2(inter))
    grid = (rows.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](rows, out, inter, rows.stride(0), BLOCK=block, num_warps=4 if block >= 512 else 1)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch silu_and_mul, as ``pagoda.layers.activation.SiluAndMul("silu")`` computes it."""
    _check_args(x)
    gate, up = x.chunk(2, dim=-1)  # each: [..., inter]
    return F.silu(gate) * up
