"""RMSNorm and residual-add + RMSNorm as Triton kernels, one program per row, with torch references.

Numerics follow transformers' LlamaRMSNorm exactly (and ``pagoda.layers.norm.RMSNorm``): the mean of
squares and the reciprocal root are computed in float32, the normalised value is rounded to the input
dtype, and only then multiplied by the weight, that product being rounded to the input dtype again.
Reordering these steps (e.g. multiplying by the weight in float32) changes bf16 results enough to flip
greedy tokens. For the fused variant the sum ``x + residual`` is rounded to the input dtype first, as
the unfused model's ``residual + hidden`` is.

Inputs are ``[..., hidden]``. Rows may be strided (a slice of a wider tensor, or the per-head view
``[num_tokens, num_heads, head_dim]`` of a split qkv projection that Qwen3's q/k norms see); only the
last dimension must be contiguous (it is made so otherwise). Outputs are new contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels.host import unit_last_stride

# One program holds a whole row in registers; beyond this the row would have to be processed in chunks.
_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows_outer, rows_inner, hidden], any strides with unit stride along hidden
    res_ptr,  # same layout as x (read only when HAS_RESIDUAL)
    w_ptr,  # [hidden]
    out_ptr,  # [rows_outer * rows_inner, hidden] contiguous
    sum_ptr,  # [rows_outer * rows_inner, hidden] contiguous (written only when HAS_RESIDUAL)
    rows_inner,
    x_stride_outer,
    x_stride_inner,
    res_stride_outer,
    res_stride_inner,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // rows_inner
    inner = row % rows_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden

    x = tl.load(x_ptr + outer * x_stride_outer + inner * x_stride_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + outer * res_stride_outer + inner * res_stride_inner + cols, mask=mask, other=0.0)
        # Rounded to the activation dtype before the statistics, as the unfused residual add is.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * hidden + cols, x, mask=mask)

    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden
    rstd = tl.math.rsqrt(variance + eps)
    normed = (x32 * rstd).to(x.dtype)  # HF rounds here, before the weight multiply
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * hidden + cols, out, mask=mask)


def _check_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension ([..., hidden])")
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match x's last dimension, got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal x dtype {x.dtype} (the multiply rounds in x.dtype)")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if x.shape[-1] > _MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[-1]} exceeds the supported maximum {_MAX_HIDDEN}")


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows_outer, rows_inner, hidden] view of t (copying only when no such view exists)."""
    t = unit_last_stride(t)
    if t.dim() == 3:
        return t
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(-1, 1, t.shape[-1])


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if x.numel() == 0:
        return out, summed
    x3 = _as_rows(x)  # [rows_outer, rows_inner, hidden]
    r3 = _as_rows(residual) if residual is not None else x3
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 512, 1), 16)
    _rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
        x3,
        r3,
        weight,
        out,
        summed,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm of x: [..., hidden] with weight: [hidden] (same dtype) -> new [..., hidden] in x.dtype."""
    _check_args(x, weight)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = (x + residual) rounded to x.dtype; x, residual: [..., hidden].

    Both results are new tensors; the inputs are not modified.
    """
    _check_args(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual ({tuple(residual.shape)}, {residual.dtype}, {residual.device}) must match "
            f"x ({tuple(x.shape)}, {x.dtype}, {x.device})"
        )
    return _launch(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-torch rms_norm, step for step as transformers' LlamaRMSNorm (the spec for the kernel)."""
    _check_args(x, weight)
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)  # [..., 1]
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch fused_add_rms_norm: the model's unfused ``residual + hidden`` followed by its norm."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("residual must match x in shape and dtype")
    summed = x + residual  # rounded to x.dtype by torch
    return rms_norm_reference(summed, weight, eps), summed
