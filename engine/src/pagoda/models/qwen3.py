"""Qwen3: the Llama decoder plus an RMSNorm over each head of q and k before RoPE."""

from __future__ import annotations

from pagoda.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Llama attention with per-head q_norm/k_norm (weights shared across heads)."""

    qk_norm = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (Qwen3-0.6B ... 32B)."""

    attention_cls = Qwen3Attention
