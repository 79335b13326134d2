"""Qwen3: the Llama decoder plus an RMSNorm over each head of q and k before RoPE."""

from __future__ import annotations

import torch

from pagoda.distributed.parallel import SINGLE, TensorParallel
from pagoda.distributed.sharding import ShardLayout
from pagoda.layers import RMSNorm
from pagoda.model_config import ModelConfig
from pagoda.models.llama import LlamaAttention, LlamaForCausalLM
from pagoda.worker.attention import AttentionBackend


class Qwen3Attention(LlamaAttention):
    """Llama attention with per-head q_norm/k_norm (weights shared across heads)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        shard: ShardLayout,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(config, layer_idx, backend, dtype, shard, tp)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]; norm over head_dim
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (Qwen3-0.6B ... 32B)."""

    attention_cls = Qwen3Attention
