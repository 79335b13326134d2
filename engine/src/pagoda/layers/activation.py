"""Gated activations for the fused gate/up projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.cpu import use_fused_ops
from pagoda.kernel_loading import load_kernel

# The fused CPU op saves per-op overhead at decode. In bf16 it is vectorised (AVX512-BF16) and also beats
# PyTorch's silu + mul on prefill (1.8 vs 3.4 ms at 2048 x 3072); the fp16 path has a scalar exp, which
# loses beyond a few rows (3.6 ms vs ~1 ms at 512 x 3072).
FUSED_MAX_ROWS_FP16 = 8

_ACT_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function transformers uses for ``hidden_act`` = name."""
    if name not in _ACT_FNS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(_ACT_FNS)})")
    return _ACT_FNS[name]


class SiluAndMul(nn.Module):
    """act(gate) * up for an input laid out as [gate | up] along the last dimension."""

    def __init__(self, act: str = "silu") -> None:
        super().__init__()
        self.act_fn = get_act_fn(act)
        self.is_silu = self.act_fn is F.silu  # the fused CUDA kernel implements silu only

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * intermediate]
        if self.is_silu and use_fused_ops(x) and (x.dtype == torch.bfloat16 or x.shape[0] <= FUSED_MAX_ROWS_FP16):
            return torch.ops.pagoda_cpu.silu_and_mul(x)  # one op instead of three
        if x.is_cuda and self.is_silu and (fused := load_kernel("activation", "silu_and_mul")) is not None:
            return fused(x)  # one pass over x instead of three elementwise kernels
        gate, up = x.chunk(2, dim=-1)  # each: [num_tokens, intermediate]
        return self.act_fn(gate) * up
