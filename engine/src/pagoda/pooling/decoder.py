"""The Llama-family decoders (Qwen3-Embedding, Qwen3-Reranker, ...) run without a KV cache, for pooling.

The model is the generation engine's own class (:mod:`pagoda.models`, same weights, kernels and layers); only the
attention call differs: a padded batch attends causally with one torch SDPA call per layer, nothing is cached, and
the last layer carries only the rows that are pooled (each sequence's last token) past attention.

Embedding checkpoints are often saved as the bare decoder (``Qwen3Model``: tensors without the ``model.`` prefix and
no ``lm_head``); both spellings load. A reranker keeps two rows of its ``lm_head``: the ``no`` and ``yes`` tokens'.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.torch_backend import TorchAttentionBackend
from pagoda.layers import apply_rotary_qk
from pagoda.loader import iterate_safetensors
from pagoda.model_config import ModelConfig
from pagoda.models.llama import LlamaDecoderLayer
from pagoda.models.registry import get_model_class, supported_architectures

# Bare decoders (saved without a head) run as the causal LM class of the family.
_BARE_DECODERS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


def decoder_architectures() -> list[str]:
    """Architectures :class:`DecoderPooler` loads."""
    return sorted({*supported_architectures(), *_BARE_DECODERS})


class DecoderPooler(nn.Module):
    """A decoder's final hidden state at each sequence's last token (and, for a reranker, two logits there)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, keep_lm_head: bool) -> None:
        super().__init__()
        if config.sliding_window is not None:
            raise ValueError("pooling with sliding-window attention is not supported")
        architecture = _BARE_DECODERS.get(config.architecture, config.architecture)
        with torch.device(device):
            self.lm = get_model_class(architecture)(config, TorchAttentionBackend(), dtype)
        if not keep_lm_head:
            del self.lm.lm_head
        self.config = config

    def load(self, weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
        """Fill the weights from checkpoint tensors of either spelling (with or without ``model.``)."""
        keep_head = hasattr(self.lm, "lm_head")

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("lm_head."):
                    if not keep_head:
                        continue
                elif not name.startswith("model."):
                    name = "model." + name
                yield name, tensor.to(dtype)

        self.lm.load_weights(renamed())

    def head_rows(self, token_ids: list[int]) -> torch.Tensor:
        """The lm_head rows of ``token_ids`` ([len, hidden], a copy), before the layer gets a packed kernel."""
        return self.lm.lm_head.weight[token_ids].detach().clone()

    def drop_lm_head(self) -> None:
        if hasattr(self.lm, "lm_head"):
            del self.lm.lm_head

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids: [batch, seq] right-padded, lengths: [batch] -> the last tokens' final hidden [batch, hidden]."""
        batch, seq = input_ids.shape
        device = input_ids.device
        model = self.lm.model
        positions = torch.arange(seq, device=device).repeat(batch)  # [batch * seq]
        hidden = model.embed_tokens(input_ids.reshape(-1))  # [batch * seq, hidden]
        cos, sin = model.rotary_emb(positions, hidden.dtype)
        keys = torch.arange(seq, device=device)
        causal = keys[None, :] <= keys[:, None]  # [seq (query), seq (key)]
        mask = causal[None, None] & (keys[None, None, None, :] < lengths[:, None, None, None])  # [batch, 1, seq, seq]
        full = bool((lengths == seq).all())  # every row full: SDPA's causal kernel, no mask
        last_rows = torch.arange(batch, device=device) * seq + lengths - 1  # [batch]
        residual: Optional[torch.Tensor] = None
        for i, layer in enumerate(model.layers):
            keep = last_rows if i == len(model.layers) - 1 else None
            hidden, residual = _layer(layer, hidden, residual, cos, sin, None if full else mask, batch, keep)
        return model.norm(hidden, residual)[0]


def _layer(
    layer: LlamaDecoderLayer,
    hidden: torch.Tensor,  # [batch * seq, hidden]
    residual: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: Optional[torch.Tensor],  # [batch, 1, seq, seq] bool; None: causal over full rows
    batch: int,
    keep: Optional[torch.Tensor],  # rows carried past attention (the last layer's pooled rows); None: all
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer as :class:`~pagoda.models.llama.LlamaDecoderLayer` runs it, with SDPA over the padded
    batch instead of the paged attention backend."""
    if residual is None:
        residual = hidden
        hidden = layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    attn = layer.self_attn
    num_tokens = hidden.shape[0]
    seq = num_tokens // batch
    q, k, v = attn.qkv_proj(hidden).split(attn.split_sizes, dim=-1)
    q = q.view(num_tokens, attn.num_heads, attn.head_dim)
    k = k.view(num_tokens, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
    q, k = attn.normalize_qk(q, k)
    q, k = apply_rotary_qk(q, k, cos, sin)

    def heads(x: torch.Tensor) -> torch.Tensor:  # [batch * seq, heads, dim] -> [batch, heads, seq, dim]
        return x.reshape(batch, seq, x.shape[1], attn.head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        heads(q),
        heads(k),
        heads(v),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=attn.num_heads != attn.num_kv_heads,
    )
    out = out.transpose(1, 2).reshape(num_tokens, attn.num_heads * attn.head_dim)
    if keep is not None:
        out, residual = out[keep], residual[keep]
    hidden, residual = layer.post_attention_layernorm(attn.o_proj(out), residual)
    return layer.mlp(hidden), residual


def load_decoder(config: ModelConfig, dtype: torch.dtype, device: torch.device, keep_lm_head: bool) -> DecoderPooler:
    """The decoder of ``config.model_dir`` with its weights."""
    model = DecoderPooler(config, dtype, device, keep_lm_head)
    model.load(iterate_safetensors(config.model_dir, device), dtype)
    return model.eval()
