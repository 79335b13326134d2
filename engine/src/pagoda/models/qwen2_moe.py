"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v bias) with routed experts plus one
shared expert on every token, scaled by ``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

import torch

from pagoda.attention.protocol import AttentionBackend
from pagoda.distributed.parallel import SINGLE, TensorParallel
from pagoda.model_config import ModelConfig
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.qwen3_moe import MoeCausalLMMixin, qwen_moe_args


class Qwen2MoeForCausalLM(MoeCausalLMMixin, LlamaForCausalLM):
    """Qwen2-MoE: Llama attention with q/k/v bias, routed experts and the gated shared expert."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        self.moe_args = qwen_moe_args(config)  # build_mlp reads it during the base constructor
        super().__init__(config, attn_backend, dtype, tp)
