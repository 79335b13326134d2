"""RMSNorm exactly as transformers' LlamaRMSNorm computes it."""

from __future__ import annotations

from typing import Optional, Union, overload

import torch
from torch import nn

from pagoda.cpu import use_fused_ops
from pagoda.kernel_loading import load_kernel


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    The statistics are computed in float32 and the normalised value is cast back to the input
    dtype *before* the weight multiply, as HF Llama does; fusing or reordering these steps changes
    bf16 results enough to flip greedy tokens.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """norm(x), or with ``residual``: (norm(s), s) for s = x + residual rounded to x's dtype
        (the pre-norm decoder's residual add, fused with the norm that follows it)."""
        if use_fused_ops(x):
            if residual is None:
                return torch.ops.pagoda_cpu.rms_norm(x, self.weight, self.eps)
            return torch.ops.pagoda_cpu.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if x.is_cuda and residual is not None and (fused := load_kernel("rms_norm", "fused_add_rms_norm")):
            return fused(x, residual, self.weight, self.eps)
        if x.is_cuda and residual is None and (fused := load_kernel("rms_norm", "rms_norm")) is not None:
            return fused(x, self.weight, self.eps)  # one launch, same rounding steps as below
        if residual is not None:
            x = x + residual
            return self._reference(x), x
        return self._reference(x)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden_size]
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)  # [..., 1]
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
