"""Llama-family decoder (Llama 2/3, TinyLlama, Mistral, Qwen2); Qwen3 subclasses it.

The families differ only in switches read from :class:`ModelConfig` (projection biases, sliding
window per layer, tied embeddings, RoPE scaling). Module and parameter names follow transformers,
except that q/k/v and gate/up are fused into ``qkv_proj`` and ``gate_up_proj`` at load time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from pagoda.attention.protocol import AttentionBackend, AttentionMetadata
from pagoda.distributed.parallel import SINGLE, TensorParallel
from pagoda.distributed.sharding import ShardLayout
from pagoda.layers import (
    Attention,
    Embedding,
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    apply_rotary_qk,
)
from pagoda.model_config import ModelConfig
from pagoda.models.weights import load_named_weights


class KVCacheSpec(NamedTuple):
    """What the KV cache allocator needs: one cache tensor per layer of this shape per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v projection and rotate-half RoPE.

    Under tensor parallelism a rank holds ``shard.num_heads`` query heads and their KV heads (q/k/v column-parallel)
    and the matching columns of ``o_proj`` (row-parallel): its output is a partial sum, completed by one all-reduce.
    """

    # Qwen3 normalises each head of q and k (RMSNorm over head_dim, weights shared across heads) before RoPE.
    qk_norm: bool = False

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        shard: ShardLayout,
        tp: TensorParallel = SINGLE,
        **attention_options: Any,  # the Attention layer's family options: scale, logits_soft_cap, sinks
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = MergedLinear(config.hidden_size, self.split_sizes, config.qkv_bias, dtype)
        self.o_proj = Linear(q_size, config.hidden_size, config.o_proj_bias, dtype)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            backend,
            config.layer_sliding_windows[layer_idx],
            **attention_options,
        )
        if self.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head q/k norms where the family has them (q: [num_tokens, num_heads, head_dim], k likewise)."""
        if not self.qk_norm:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,  # [num_tokens, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        keep: Optional[torch.Tensor] = None,  # [num_kept] token rows the output keeps; None: all
    ) -> torch.Tensor:  # [num_tokens or num_kept, hidden]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.normalize_qk(q, k)
        q, k = apply_rotary_qk(q, k, cos, sin)
        out = self.attn(q, k, v, kv_cache, meta)  # [num_tokens, num_heads, head_dim]; every K/V row is cached
        if keep is not None:
            out = out[keep]  # [num_kept, num_heads, head_dim]
        out = self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))
        return self.tp.all_reduce(out)  # [num_tokens or num_kept, hidden]: the ranks' partial sums added


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with gate and up projections fused into one GEMM (column-parallel under tensor
    parallelism, ``down_proj`` row-parallel with one all-reduce)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, shard: ShardLayout, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        inter = shard.intermediate_size
        self.act = SiluAndMul(config.hidden_act)
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], config.mlp_bias, dtype, self.act.is_silu)
        self.down_proj = Linear(inter, config.hidden_size, config.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        hidden = self.gate_up_proj.forward_silu_and_mul(x)  # [num_tokens, intermediate] where the kernel fuses it
        if hidden is None:
            hidden = self.act(self.gate_up_proj(x))  # gate_up: [num_tokens, 2 * intermediate]
        return self.tp.all_reduce(self.down_proj(hidden))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; each residual add is fused into the following norm with transformers' rounding."""

    def __init__(self, attn: LlamaAttention, mlp: LlamaMLP, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output (or the embeddings)
        residual: Optional[torch.Tensor],  # [num_tokens, hidden]: the stream before that output; None at layer 0
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: Optional[torch.Tensor] = None,  # token rows to carry past attention (the last layer); None: all
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the residual stream it adds to)
        # Each residual add is fused into the norm that follows it; the sum is rounded to the
        # activation dtype before the norm, exactly as transformers' separate add does.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta, keep)
        if keep is not None:
            residual = residual[keep]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (transformers' ``model.*`` submodule)."""

    def __init__(
        self,
        config: ModelConfig,
        layers: list[LlamaDecoderLayer],
        dtype: torch.dtype,
        shard: ShardLayout,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(shard.vocab_shard, config.hidden_size, dtype, shard.vocab_start, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over a flattened (varlen) batch and a paged KV cache."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.attn_backend = attn_backend
        self.tp = tp
        self.shard = ShardLayout.for_rank(config, tp.rank, tp.world_size)
        layers = [
            LlamaDecoderLayer(
                self.attention_cls(config, i, attn_backend, dtype, self.shard, tp),
                self.build_mlp(i, dtype),
                config,
                dtype,
            )
            for i in range(config.num_hidden_layers)
        ]
        self.model = LlamaModel(config, layers, dtype, self.shard, tp)
        # Tied embeddings share one Parameter; the checkpoint's lm_head.weight (if any) is ignored, as in HF.
        tied = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, self.shard.vocab_shard, bias=False, dtype=dtype, shared_weight=tied)

    def build_mlp(self, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """The feed-forward of decoder layer ``layer_idx`` (mixture-of-experts families override this)."""
        return LlamaMLP(self.config, dtype, self.shard, self.tp)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Shape of this rank's per-layer KV cache (see :mod:`pagoda.attention.protocol` for the layout)."""
        return KVCacheSpec(self.config.num_hidden_layers, self.shard.num_kv_heads, self.config.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_meta: AttentionMetadata,
        output_rows: Optional[torch.Tensor] = None,  # [num_out] int64 token indices; None: every token
    ) -> torch.Tensor:  # [num_tokens or num_out, hidden] after the final norm
        """Run every layer over this step's tokens, writing their K/V into ``kv_caches``.

        With ``output_rows`` (the tokens whose logits the step needs) the last layer runs its output
        projection, MLP and the final norm on those rows only. After attention each row depends on its own
        token alone, so the rows are what the full pass computes. At the Qwen3-0.6B shape a prompt that samples
        once skips ~2.6% of its FLOPs.
        """
        assert len(kv_caches) == len(self.model.layers), (len(kv_caches), len(self.model.layers))
        if not attn_meta.backend_state:
            self.attn_backend.prepare(attn_meta)  # once per step, shared by all layers
        hidden = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos, sin = self.model.rotary_emb(positions, hidden.dtype)  # each [num_tokens, head_dim]
        residual: Optional[torch.Tensor] = None
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            keep = output_rows if i == last else None
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn_meta, keep)
        return self.model.norm(hidden, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden: [n, hidden] -> logits [n, vocab] float32 (the GEMM runs in the model dtype, as in HF).

        Under tensor parallelism each rank computes its vocabulary rows and rank 0 gathers them (None elsewhere).
        """
        return self.gather_logits(self.lm_head.forward_float32(hidden))

    def gather_logits(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's vocabulary rows [n, vocab_shard] -> the whole [n, vocab] on rank 0 (None on the others)."""
        if self.tp.world_size == 1:
            return logits
        gathered = self.tp.gather_to_first(logits)  # [n, world_size * vocab_shard] on rank 0
        return None if gathered is None else gathered[:, : self.config.vocab_size]

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; return the parameter names filled.

        Raises ValueError for unexpected names, shape mismatches and parameters the checkpoint
        does not provide.
        """
        skip: Optional[set[str]] = {"lm_head.weight"} if self.config.tie_word_embeddings else None
        return load_named_weights(self, weights, skip_names=skip)

    def read_shard(self, name: str, tensor_slice: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (``tensor_slice``: safetensors' lazy slice)."""
        return self.shard.read(name, tensor_slice, self.config.num_key_value_heads)
