"""Rotary position embeddings (rotate-half layout), computed like transformers' Llama."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from pagoda.cpu import use_fused_ops
from pagoda.kernel_loading import load_kernel
from pagoda.model_config import RopeScaling


def compute_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 for default, linear or llama3 RoPE.

    Computed on the CPU with the same expression as transformers' ROPE_INIT_FUNCTIONS so the
    float32 values match bit for bit.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    assert scaling.rope_type == "llama3", scaling.rope_type
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
    assert scaling.original_max_position_embeddings is not None
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary positions, computed per step (no max-length table to outgrow)."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, theta, scaling).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 2] float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] int64 -> (cos, sin), each [num_tokens, head_dim] in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [num_tokens, head_dim // 2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        # Rounded to the activation dtype before use, as transformers does.
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [num_tokens, num_heads, head_dim] by cos/sin: [num_tokens, head_dim] (activation dtype).

    On the CPU in 16-bit dtypes one fused op does the work, rounding each product to the dtype
    before the add exactly as the expression below does (CUDA: see :func:`apply_rotary_qk`).
    """
    if use_fused_ops(x):
        return torch.ops.pagoda_cpu.rotary(x, cos, sin)  # one op, the same rounding steps as below
    cos = cos.unsqueeze(1)  # [num_tokens, 1, head_dim]
    sin = sin.unsqueeze(1)
    return (x * cos) + (_rotate_half(x) * sin)


def apply_rotary_qk(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim]
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the same positions (one Triton launch for both on CUDA)."""
    if q.is_cuda and (fused := load_kernel("rotary", "apply_rotary")) is not None:
        return fused(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
