"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

Both are the Llama decoder's projections (fused q/k/v and gate/up, the same tensor-parallel layout and LoRA
targets) with Gemma's numerics, each written the way transformers 5 computes it:

- the embedding is multiplied by ``sqrt(hidden_size)`` rounded to the activation dtype (in bf16, sqrt(3072) is 55.5);
- every RMSNorm is ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` in float32, rounded once at the end (Llama rounds
  before the weight multiply, so :class:`pagoda.layers.RMSNorm` and its fused kernels do not apply);
- four norms per layer: input, post-attention (on the attention output, before the residual add), pre- and
  post-feedforward;
- a GELU-tanh gated MLP (``hidden_activation``), softmax scale ``query_pre_attn_scalar ** -0.5``;
- sliding-window layers per ``layer_types`` (see :func:`pagoda.model_config.gemma_layer_types`);
- Gemma 2: attention-logit soft-capping and final-logit soft-capping (the latter in the model dtype, as HF);
- Gemma 3: per-head q_norm/k_norm, a second RoPE table for the sliding layers (``rope_local_base_freq`` or
  transformers 5's per-layer-type ``rope_parameters``) and the global layers' own scaling (linear x8 in 4B+).
  transformers' Gemma 3 attention never soft-caps its scores, so ``attn_logit_softcapping`` is ignored here too.

Every layer caches its whole K/V (the sliding layers' old blocks are kept, not reclaimed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from pagoda.attention.protocol import AttentionBackend, AttentionMetadata
from pagoda.distributed.parallel import SINGLE, TensorParallel
from pagoda.distributed.sharding import ShardLayout
from pagoda.layers import Embedding, Linear, RotaryEmbedding
from pagoda.model_config import ModelConfig, RopeScaling, gemma_layer_types, parse_rope
from pagoda.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

Rope = tuple[float, Optional[RopeScaling]]  # (base, scaling)


@dataclass(frozen=True)
class GemmaParams:
    """The family fields of a Gemma config.json, resolved with Gemma2Config's / Gemma3TextConfig's defaults."""

    activation: str
    query_pre_attn_scalar: float
    attn_logit_softcap: Optional[float]
    final_logit_softcap: Optional[float]
    qk_norm: bool
    layer_types: tuple[str, ...]
    global_rope: Rope
    local_rope: Rope  # the sliding layers' (Gemma 2: the same as global_rope)

    @classmethod
    def from_config(cls, config: ModelConfig, family: str) -> GemmaParams:
        """Parse ``config.raw``; ValueError for a config these classes cannot serve."""
        raw = config.raw
        if raw.get("use_bidirectional_attention"):
            raise ValueError(f"{config.architecture} with use_bidirectional_attention (an encoder) is not supported")
        gemma2 = family == "gemma2"
        if gemma2:
            global_rope = local_rope = (config.rope_theta, config.rope_scaling)
        else:
            global_rope, local_rope = _gemma3_ropes(raw)
        return cls(
            activation=str(raw.get("hidden_activation") or "gelu_pytorch_tanh"),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
            attn_logit_softcap=_optional_cap(raw, "attn_logit_softcapping", 50.0) if gemma2 else None,
            final_logit_softcap=_optional_cap(raw, "final_logit_softcapping", 30.0 if gemma2 else None),
            qk_norm=not gemma2,
            layer_types=tuple(gemma_layer_types(config.architecture, raw, config.num_hidden_layers)),
            global_rope=global_rope,
            local_rope=local_rope,
        )


def _optional_cap(raw: dict[str, Any], key: str, default: Optional[float]) -> Optional[float]:
    value = raw.get(key, default)  # an explicit null turns the cap off
    return None if value is None else float(value)


def _gemma3_ropes(raw: dict[str, Any]) -> tuple[Rope, Rope]:
    """(full-attention, sliding-attention) RoPE, as Gemma3TextConfig.convert_rope_params_to_dict resolves them:
    transformers 5's ``rope_parameters`` per layer type, else the legacy ``rope_theta`` (1M) with ``rope_scaling``
    for the global layers and ``rope_local_base_freq`` (10k) for the local ones."""
    params = raw.get("rope_parameters")
    per_type = params if isinstance(params, dict) and {"full_attention", "sliding_attention"} & set(params) else {}
    full = dict(per_type.get("full_attention") or {"rope_type": "default"})
    local = dict(per_type.get("sliding_attention") or {"rope_type": "default"})
    if raw.get("rope_scaling"):
        full.update(raw["rope_scaling"])
    full.setdefault("rope_theta", raw.get("rope_theta") or 1_000_000.0)
    local.setdefault("rope_theta", raw.get("rope_local_base_freq") or 10_000.0)
    base = {"max_position_embeddings": raw.get("max_position_embeddings"), "model_type": raw.get("model_type")}
    return parse_rope({**base, "rope_parameters": full}), parse_rope({**base, "rope_parameters": local})


class GemmaRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last dimension in float32, rounded to x's dtype
    once at the end (transformers' Gemma2RMSNorm / Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., hidden_size]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaAttention(LlamaAttention):
    """Llama's fused-projection attention with Gemma's softmax scale, soft cap and (Gemma 3) q/k norms."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        shard: ShardLayout,
        tp: TensorParallel,
        params: GemmaParams,
    ) -> None:
        scale, cap = params.query_pre_attn_scalar**-0.5, params.attn_logit_softcap
        super().__init__(config, layer_idx, backend, dtype, shard, tp, scale=scale, logits_soft_cap=cap)
        self.qk_norm = params.qk_norm  # read by LlamaAttention.normalize_qk
        if params.qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block: each sublayer's input and output are normalised, then added to the stream."""

    def __init__(self, attn: GemmaAttention, mlp: LlamaMLP, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the residual stream
        cos: torch.Tensor,  # [num_tokens, head_dim]: this layer kind's RoPE
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: Optional[torch.Tensor] = None,  # token rows to carry past attention (the last layer); None: all
    ) -> torch.Tensor:  # [num_tokens or num_kept, hidden]
        attn_out = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta, keep)
        if keep is not None:
            hidden = hidden[keep]
        hidden = hidden + self.post_attention_layernorm(attn_out)  # rounded to the dtype, as HF's separate add
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    """Embedding, decoder layers, final norm and the RoPE tables (transformers' ``model.*`` submodule)."""

    def __init__(
        self,
        config: ModelConfig,
        params: GemmaParams,
        layers: list[GemmaDecoderLayer],
        dtype: torch.dtype,
        shard: ShardLayout,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(shard.vocab_shard, config.hidden_size, dtype, shard.vocab_start, tp)
        # HF keeps sqrt(hidden) as a float32 buffer and rounds it to the weight's dtype at every lookup.
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, *params.global_rope)
        self.rotary_emb_local: Optional[RotaryEmbedding] = None
        if params.local_rope != params.global_rope:
            self.rotary_emb_local = RotaryEmbedding(config.head_dim, *params.local_rope)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 decoder over a flattened (varlen) batch and a paged KV cache; the KV cache spec, weight loading and
    sharding are the Llama decoder's."""

    family: ClassVar[str] = "gemma2"

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        nn.Module.__init__(self)  # its own layers, not LlamaForCausalLM's
        self.params = GemmaParams.from_config(config, self.family)
        # The shared MLP reads the activation from ModelConfig, whose default (silu) is not Gemma's.
        config = dataclasses.replace(config, hidden_act=self.params.activation)
        self.config = config
        self.dtype = dtype
        self.attn_backend = attn_backend
        self.tp = tp
        self.shard = ShardLayout.for_rank(config, tp.rank, tp.world_size)
        layers = [
            GemmaDecoderLayer(
                GemmaAttention(config, i, attn_backend, dtype, self.shard, tp, self.params),
                LlamaMLP(config, dtype, self.shard, tp),
                config,
                dtype,
            )
            for i in range(config.num_hidden_layers)
        ]
        self.model = GemmaModel(config, self.params, layers, dtype, self.shard, tp)
        tied = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, self.shard.vocab_shard, bias=False, dtype=dtype, shared_weight=tied)
        self._local_layers = [kind == "sliding_attention" for kind in self.params.layer_types]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_meta: AttentionMetadata,
        output_rows: Optional[torch.Tensor] = None,  # [num_out] int64 token indices; None: every token
    ) -> torch.Tensor:  # [num_tokens or num_out, hidden] after the final norm
        """Run every layer over this step's tokens, writing their K/V into ``kv_caches``; with ``output_rows`` the
        last layer runs past attention on those rows only (as :meth:`LlamaForCausalLM.forward`)."""
        assert len(kv_caches) == len(self.model.layers), (len(kv_caches), len(self.model.layers))
        if not attn_meta.backend_state:
            self.attn_backend.prepare(attn_meta)  # once per step, shared by all layers
        hidden = self.model.embed_tokens(input_ids) * self.model.embed_scale  # [num_tokens, hidden]
        global_rope = self.model.rotary_emb(positions, hidden.dtype)  # (cos, sin), each [num_tokens, head_dim]
        local_rope = global_rope
        if self.model.rotary_emb_local is not None:
            local_rope = self.model.rotary_emb_local(positions, hidden.dtype)
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            cos, sin = local_rope if self._local_layers[i] else global_rope
            hidden = layer(hidden, cos, sin, kv_cache, attn_meta, output_rows if i == last else None)
        return self.model.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden: [n, hidden] -> logits [n, vocab] float32; soft-capped ``cap * tanh(logits / cap)`` in the model
        dtype where the config has a final cap (as HF). Under tensor parallelism rank 0 gathers (None elsewhere)."""
        cap = self.params.final_logit_softcap
        if cap is None:
            logits = self.lm_head.forward_float32(hidden)  # [n, vocab_shard]
        else:
            logits = (torch.tanh(self.lm_head(hidden) / cap) * cap).float()
        return self.gather_logits(logits)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text decoder (gemma-3-270m, gemma-3-1b; the 4B+ models ship as the multimodal
    Gemma3ForConditionalGeneration, refused by :mod:`pagoda.model_config`)."""

    family: ClassVar[str] = "gemma3"
