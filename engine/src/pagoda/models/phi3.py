"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): the Llama decoder with checkpoint-fused projections.

Phi-3-mini/medium, Phi-3.5-mini and Phi-4-mini compute exactly what the Llama decoder computes (pre-norm RMSNorm
blocks, SwiGLU, no biases, optionally tied embeddings); what differs is read from the config by the shared layers:
LongRoPE and a partial rotary factor (Phi-4-mini rotates the first 3/4 of each head; see
:mod:`pagoda.layers.rotary`), and one sliding window on every layer when config.json sets ``sliding_window``
(Phi-3-mini-4k: 2047), as transformers' Phi3Attention does.

The checkpoints store ``self_attn.qkv_proj`` ([q | k | v] rows) and ``mlp.gate_up_proj`` ([gate | up] rows) already
fused, which is the layout of Pagoda's own fused projections, so each loads as one tensor. Under tensor parallelism
a rank reads its heads of each of q, k and v (its slice of each of gate and up) out of the fused tensor and
concatenates them. AWQ/GPTQ checkpoints of these models quantize the pre-fused tensors, whose packed columns the
quantized loaders split per projection only; they are refused at load with a message saying so (fp8 applied at
load time to a dense checkpoint works: it quantizes after loading).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.weights import load_named_weights

_QKV, _GATE_UP = ".self_attn.qkv_proj.", ".mlp.gate_up_proj."


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini decoder over a flattened batch and a paged KV cache."""

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names, q/k/v and gate/up already fused) into the parameters.

        Raises ValueError for a serialized-quantized (AWQ/GPTQ/...) checkpoint, unexpected names, shape mismatches
        and parameters the checkpoint does not provide.
        """
        quant = getattr(self, "quant_config", None)
        if quant is not None and quant.serialized:
            raise ValueError(
                f"{quant.method} checkpoints of {self.config.architecture} are not supported: they quantize the "
                "pre-fused qkv_proj and gate_up_proj tensors, which Pagoda's quantized loaders cannot split per "
                "projection yet; serve the dense checkpoint (optionally with --quantization fp8 or int8)"
            )
        skip: Optional[set[str]] = {"lm_head.weight"} if self.config.tie_word_embeddings else None
        return load_named_weights(self, weights, skip_names=skip)

    def read_shard(self, name: str, tensor_slice: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name``; fused q/k/v and gate/up give this rank's rows of each part.

        ``tensor_slice`` is safetensors' lazy slice: only the rows this rank keeps are read.
        """
        if self.tp.world_size == 1 or (_QKV not in name and _GATE_UP not in name):
            return self.shard.read(name, tensor_slice, self.config.num_key_value_heads)
        ranges = self._qkv_rows() if _QKV in name else self._gate_up_rows()
        return torch.cat([tensor_slice[start : start + size] for start, size in ranges])

    def _qkv_rows(self) -> list[tuple[int, int]]:
        """(first row, rows) of this rank's query heads, then its KV heads in k and in v, in the fused tensor."""
        head_dim, shard = self.config.head_dim, self.shard
        total_kv = self.config.num_key_value_heads
        q_total, kv_total = self.config.num_attention_heads * head_dim, total_kv * head_dim
        q_size, kv_size = shard.num_heads * head_dim, shard.num_kv_heads * head_dim
        kv_start = shard.kv_head_start(total_kv) * head_dim
        return [(shard.rank * q_size, q_size), (q_total + kv_start, kv_size), (q_total + kv_total + kv_start, kv_size)]

    def _gate_up_rows(self) -> list[tuple[int, int]]:
        """(first row, rows) of this rank's slice of gate, then of up, in the fused tensor."""
        size = self.shard.intermediate_size
        return [(self.shard.rank * size, size), (self.config.intermediate_size + self.shard.rank * size, size)]
