"""The attention layer: per-layer constants plus a call into the step's attention backend."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from pagoda.attention.protocol import AttentionBackend, AttentionLayerSpec, AttentionMetadata


class Attention(nn.Module):
    """Writes this step's K/V into the layer's paged cache and attends through the backend.

    ``scale`` is the softmax scale (default ``head_dim ** -0.5``; Gemma's is ``query_pre_attn_scalar ** -0.5``).
    ``logits_soft_cap`` turns scores into ``cap * tanh(scores / cap)`` before masking (Gemma 2). ``sinks=True`` gives
    the layer ``self.sinks``, a float32 parameter of one learned logit per (local) query head (gpt-oss): an extra
    softmax column per head whose probability is dropped (checkpoints name it ``self_attn.sinks``).

    ``k_scale`` / ``v_scale`` are the per-tensor scales of an fp8 KV cache (a cached key is its fp8 code times
    k_scale); 1.0 unless the checkpoint has them, and unused by a cache in the model's dtype.
    """

    k_scale: float = 1.0
    v_scale: float = 1.0

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        sliding_window: Optional[int] = None,
        *,
        scale: Optional[float] = None,
        logits_soft_cap: Optional[float] = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        for name, value in (("scale", scale), ("logits_soft_cap", logits_soft_cap)):
            if value is not None and not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"attention {name} must be a finite positive number, got {value}")
        self.spec = AttentionLayerSpec(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scale=head_dim**-0.5 if scale is None else float(scale),
            sliding_window=sliding_window,
            logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            has_sinks=sinks,
        )
        self.backend = backend
        self.sinks: Optional[nn.Parameter] = None
        if sinks:
            # float32 whatever the model's dtype: the backends add it to float32 scores
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Set the fp8 KV cache scales (e.g. from a checkpoint's ``self_attn.k_scale`` / ``v_scale``); call before
        CUDA graphs are captured, which bake the scales in. Raises ValueError unless both are finite and positive."""
        k_scale, v_scale = float(k_scale), float(v_scale)
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be a finite positive number, got {value}")
        self.k_scale, self.v_scale = k_scale, v_scale
        self.spec = dataclasses.replace(self.spec, k_scale=k_scale, v_scale=v_scale)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """:meth:`AttentionBackend.forward <pagoda.attention.protocol.AttentionBackend.forward>` with this layer's
        spec (the shapes are documented there)."""
        if self.sinks is None:  # the call every backend has always taken
            return self.backend.forward(q, k, v, kv_cache, meta, self.spec)
        return self.backend.forward(q, k, v, kv_cache, meta, self.spec, sinks=self.sinks)

    def extra_repr(self) -> str:
        return f"{self.spec}, backend={getattr(self.backend, 'name', type(self.backend).__name__)}"
