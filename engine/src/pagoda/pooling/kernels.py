"""GEMM kernels for pooling forwards: every row is a prompt row, so the GEMMs are compute bound.

The generation engine's CPU kernel choice (:func:`~pagoda.layers.linear_kernels.prepare_linear_layers`) is made for
decode batches; its native bf16 kernel streams the weight at batch 1 but runs a 4096-row prefill GEMM several times
slower than oneDNN on an AMX host (measured: 310 ms against 41 ms for a 4096 x 768 x 2304 bf16 GEMM). A pooling
forward is all prefill, so here every bf16/fp16 CPU layer takes oneDNN with its weight packed once (AMX where the CPU
has it), and the encoder's GELU and residual adds run in the GEMM's epilogue (one pass over the output instead of
three). float32 and CUDA keep ``F.linear``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers import Linear
from pagoda.layers.cpu_linear import PackedLinear, onednn_packing_available


class Dense(nn.Module):
    """y = x W^T + b, with the fused ``gelu`` and ``add`` epilogues of a packed oneDNN weight when it has one."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        self.packed: Optional[torch.Tensor] = None  # oneDNN's blocked layout of the weight, once packed

    def pack(self) -> None:
        """Reorder the weight once into oneDNN's layout; the plain weight is released."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def gelu(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        """gelu(x W^T + b) (``approximate``: "none" or "tanh", as ``F.gelu``)."""
        if self.packed is None:
            return F.gelu(F.linear(x, self.weight, self.bias), approximate=approximate)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "gelu", [], approximate)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x W^T + b + residual (residual: [rows, out])."""
        if self.packed is None:
            return torch.addmm(self.bias, x, self.weight.t()).add_(residual)
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")


def prepare_pooling_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, int]:
    """Pack every GEMM of ``model`` for oneDNN on a bf16/fp16 CPU; return how many layers got which kernel."""
    pack = device.type == "cpu" and onednn_packing_available(dtype)
    counts: dict[str, int] = {}
    for layer in model.modules():
        name = "torch-linear"
        if pack and isinstance(layer, Dense):
            layer.pack()
            name = "onednn-packed-fused"
        elif pack and isinstance(layer, Linear) and layer.weight is not None and layer.weight.numel():
            layer.set_kernel(
                PackedLinear.from_weight(layer.weight, None if layer.bias is None else layer.bias.detach())
            )
            name = "onednn-packed"
        elif not isinstance(layer, (Dense, Linear)):
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts
