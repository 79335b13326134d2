"""Rotary position embeddings (rotate-half layout), computed like transformers 5's ``modeling_rope_utils``.

Every ``rope_type`` config.json may name: "default", "linear", "llama3", "yarn", "dynamic" (NTK-aware) and
"longrope" (Phi-3 / Phi-4), each optionally with a ``partial_rotary_factor`` (only the first ``rotary_dim`` of each
head rotates, the rest passes through). The inverse frequencies and the attention factor (YaRN's and LongRoPE's
multiplier on cos/sin) are computed on the CPU in float32 with transformers' expressions, so they match it bit for bit.

Where this differs from transformers: two types are sequence-length dependent there, and a continuous-batching
engine must not let one request's length change another request's (or its own cached tokens') rotation. Both use a
per-token rule instead, the same in every batch:

- ``longrope``: transformers rotates *every* token of a sequence with the long factors once the sequence is longer
  than ``original_max_position_embeddings`` (and Phi-3's generate drops its KV cache to recompute it when a
  sequence crosses that length). Here a token at position ``p`` uses the short factors when ``p <
  original_max_position_embeddings`` and the long factors otherwise. Within the original context (every token of
  a sequence of at most that length) this is transformers exactly; beyond it, the tokens before the boundary keep
  their short-factor rotation. The attention factor does not depend on the length, so it is the same for both.
- ``dynamic``: transformers grows the base with the sequence length once it exceeds ``max_position_embeddings``,
  for every token of the sequence. Here the token at position ``p`` uses the base for length ``max(p + 1,
  max_position_embeddings)``: the default base within the context (transformers exactly), and beyond it what
  transformers' own token-by-token decoding computes (it recomputes the base per step and never re-rotates its
  cached keys), but not what a single transformers prefill of a longer prompt computes.

The static types (default, linear, llama3, yarn) equal transformers at every position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pagoda.cpu import use_fused_ops
from pagoda.kernel_loading import load_kernel
from pagoda.model_config import RopeScaling


@dataclass(frozen=True)
class RopeTables:
    """What one RoPE configuration computes once: frequencies [rotary_dim // 2] float32 (CPU) and a scalar."""

    inv_freq: torch.Tensor  # the static table (longrope: the short factors; dynamic: the default base)
    attention_factor: float  # multiplies cos and sin (1.0 for all but yarn and longrope)
    long_inv_freq: Optional[torch.Tensor] = None  # longrope: the table from original_max_position_embeddings on


def rotary_dim(head_dim: int, scaling: Optional[RopeScaling]) -> int:
    """How many leading elements of each head rotate (``int(head_dim * partial_rotary_factor)``)."""
    return head_dim if scaling is None else int(head_dim * scaling.partial_rotary_factor)


def _exponents(dim: int) -> torch.Tensor:
    # arange(0, dim, 2) / dim in float32, as every transformers rope function writes it.
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim


def compute_rope_tables(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> RopeTables:
    """Inverse frequencies and attention factor of one configuration, transformers' float32 values."""
    dim = rotary_dim(head_dim, scaling)
    if dim < 2 or dim % 2:
        raise ValueError(f"rotary dimension {dim} (head_dim {head_dim} x partial factor) must be even and >= 2")
    inv_freq = 1.0 / (theta ** _exponents(dim))
    kind = "default" if scaling is None else scaling.rope_type
    if kind in ("default", "dynamic"):  # dynamic: the default base up to max_position_embeddings
        return RopeTables(inv_freq, 1.0)
    assert scaling is not None
    if kind == "linear":
        return RopeTables(inv_freq / scaling.factor, 1.0)
    if kind == "llama3":
        return RopeTables(_llama3_inv_freq(inv_freq, scaling), 1.0)
    if kind == "yarn":
        return _yarn_tables(dim, theta, scaling)
    if kind == "longrope":
        return _longrope_tables(dim, theta, scaling)
    raise ValueError(f"RoPE type {kind!r} is not supported")


def compute_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> torch.Tensor:
    """The static inverse frequencies [rotary_dim // 2] float32 (see :func:`compute_rope_tables`)."""
    return compute_rope_tables(head_dim, theta, scaling).inv_freq


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_tables(dim: int, theta: float, scaling: RopeScaling) -> RopeTables:
    # High frequencies (many turns within the original context) extrapolate unchanged, low ones are interpolated
    # by factor, a linear ramp over the dimensions between; the attention factor compensates the softmax entropy.
    assert scaling.original_max_position_embeddings is not None
    factor, original = scaling.factor, scaling.original_max_position_embeddings
    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = float(_yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.beta_fast or 32, scaling.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** _exponents(dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the frequency extrapolates
    return RopeTables(interpolation * (1 - keep) + extrapolation * keep, attention)


def _longrope_tables(dim: int, theta: float, scaling: RopeScaling) -> RopeTables:
    assert scaling.original_max_position_embeddings is not None
    assert scaling.short_factor is not None and scaling.long_factor is not None
    for name, values in (("short_factor", scaling.short_factor), ("long_factor", scaling.long_factor)):
        if len(values) != dim // 2:
            raise ValueError(f"longrope {name} has {len(values)} entries; rotary dim {dim} needs {dim // 2}")
    attention = scaling.attention_factor
    if attention is None:
        factor, original = scaling.factor, scaling.original_max_position_embeddings
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** _exponents(dim)
    short = 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(scaling.long_factor, dtype=torch.float32) * base)
    return RopeTables(short, attention, long)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary positions, computed per step (no max-length table to outgrow).

    ``rotary_dim`` (<= head_dim) is the width of the tables and of the rotated part of each head.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> None:
        super().__init__()
        tables = compute_rope_tables(head_dim, theta, scaling)
        device = torch.get_default_device()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, scaling)
        self.theta = theta
        self.scaling = scaling
        self.attention_factor = tables.attention_factor
        self.register_buffer("inv_freq", tables.inv_freq.to(device), persistent=False)  # [rotary_dim // 2] fp32
        long_inv_freq = None if tables.long_inv_freq is None else tables.long_inv_freq.to(device)
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)  # longrope only, else None
        # dynamic NTK's exponents on the model's device: a host-to-device copy per step would break graph capture
        self.register_buffer("exponents", _exponents(self.rotary_dim).to(device), persistent=False)
        # Positions from which the per-token rule of the module docstring applies (None: never).
        self.switch_position: Optional[int] = None
        if scaling is not None and scaling.rope_type == "longrope":
            self.switch_position = scaling.original_max_position_embeddings
        elif scaling is not None and scaling.rope_type == "dynamic":
            self.switch_position = scaling.max_position_embeddings

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] int64 -> (cos, sin), each [num_tokens, rotary_dim] in ``dtype``."""
        freqs = positions[:, None].float() * self._token_inv_freq(positions)  # [num_tokens, rotary_dim // 2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, rotary_dim]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        # Rounded to the activation dtype before use, as transformers does.
        return cos.to(dtype), sin.to(dtype)

    def _token_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """[1, rotary_dim // 2] when every token shares the static table, else [num_tokens, rotary_dim // 2]."""
        if self.switch_position is None:
            return self.inv_freq[None, :]
        # No branch on the values (a host sync, and not allowed while a CUDA graph is captured): both tables
        # are computed and each token picks its own.
        beyond = positions >= self.switch_position  # [num_tokens]
        if self.long_inv_freq is not None:
            return torch.where(beyond[:, None], self.long_inv_freq[None, :], self.inv_freq[None, :])
        return torch.where(beyond[:, None], self._dynamic_inv_freq(positions), self.inv_freq[None, :])

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        # transformers' NTK base for sequence length max(p + 1, max_position_embeddings), per token. Its forward
        # passes the length as an int64 tensor, so the base is float32 tensor arithmetic in this order.
        assert self.scaling is not None and self.scaling.max_position_embeddings is not None
        dim, factor, limit = self.rotary_dim, self.scaling.factor, self.scaling.max_position_embeddings
        seq_len = torch.clamp(positions + 1, min=limit)  # [num_tokens] int64
        base = self.theta * ((factor * seq_len / limit) - (factor - 1)) ** (dim / (dim - 2))  # [num_tokens] fp32
        return 1.0 / (base[:, None] ** self.exponents[None, :])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if use_fused_ops(x):
        return torch.ops.pagoda_cpu.rotary(x, cos, sin)  # one op, the same rounding steps as below
    cos = cos.unsqueeze(1)  # [num_tokens, 1, head_dim]
    sin = sin.unsqueeze(1)
    return (x * cos) + (_rotate_half(x) * sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [num_tokens, num_heads, head_dim] by cos/sin: [num_tokens, rotary_dim] (activation dtype).

    With rotary_dim < head_dim (partial rotary) the first rotary_dim elements of each head rotate and the rest
    pass through, as transformers' ``cat([rotate(x_rot), x_pass])``. On the CPU in 16-bit dtypes one fused op does
    the rotation, rounding each product to the dtype before the add exactly as the expression does (CUDA: see
    :func:`apply_rotary_qk`).
    """
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return _rotate_full(x, cos, sin)
    # The native op wants whole rows: rotate a contiguous copy of the rotated part.
    return torch.cat((_rotate_full(x[..., :rot].contiguous(), cos, sin), x[..., rot:]), dim=-1)


def apply_rotary_qk(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, rotary_dim]
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the same positions (one Triton launch for both on CUDA)."""
    if q.is_cuda and (fused := load_kernel("rotary", "apply_rotary")) is not None:
        rot = cos.shape[-1]
        if rot == q.shape[-1]:
            return fused(q, k, cos, sin)
        # The kernel honours token and head strides, so it reads the rotated part of each head in place.
        q_rot, k_rot = fused(q[..., :rot], k[..., :rot], cos, sin)
        return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
