"""Gated activations for the fused gate/up projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * intermediate]
        gate, up = x.chunk(2, dim=-1)  # each: [num_tokens, intermediate]
        return self.act_fn(gate) * up
