"""Tiny random-weight checkpoints of each supported architecture, written by transformers itself.

The models are built from transformers' own config/model classes and saved with
``save_pretrained``, so the engine is tested against exactly what real checkpoints look like.
Weights are drawn with a fixed seed. ``initializer_range`` is 0.15 instead of transformers'
0.02: at 0.02 (and still at 0.05) a 64-wide random model has near-flat logits (std ~0.2) whose
top entries sit within bf16 rounding of each other, and its greedy continuation collapses into
one to four repeated tokens, so a greedy comparison would test little and flip on ties. At 0.15
the logits have std ~1.3 and 32 greedy tokens contain 17-25 distinct ids. Norm weights and
biases, which transformers initialises to ones and zeros, are randomised too so that a norm or
bias that is loaded into the wrong place (or not applied) changes the output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ARCHES = ("llama", "mistral", "qwen2", "qwen3")
EOS_TOKEN_ID = 2

_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
}

_BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=EOS_TOKEN_ID,
    tie_word_embeddings=False,
)

# Per-family flavour, chosen to resemble the real models' configs.
_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mistral": dict(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # MoE: more experts than top-k so that some go unrouted in a step; Qwen3-MoE with a dense layer in the middle
    # (mlp_only_layers), Qwen2-MoE with a dense first layer (decoder_sparse_step 2) and no renormalisation.
    # transformers 5's save_pretrained writes the published per-expert layout (experts.{e}.gate_proj / w1 ...).
    "qwen3_moe": dict(
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "mixtral": dict(
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "qwen2_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    # Phi-4-mini's shape of RoPE: LongRoPE over the first 3/4 of each head (12 of 16: 6 factors per list), the
    # pretraining context (128) a top-level field, max_position_embeddings 4x it; pad id inside the tiny vocab.
    "phi3": dict(
        pad_token_id=0,
        tie_word_embeddings=True,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.02, 1.1, 1.3, 1.7, 2.1],
            "long_factor": [1.0, 1.5, 3.0, 7.5, 16.0, 31.0],
        },
    ),
    # Gemma: hidden 72 (sqrt(72) is rounded when the embedding is scaled in bf16), query_pre_attn_scalar != head_dim,
    # a window of 8 so that prompts outrun it, soft caps low enough to bend these logits; Gemma 3 with its
    # per-layer-type RoPE (local base 10k, global 1M with the 4B+ models' linear factor 8). A smaller
    # initializer_range: with the random norm weights each (1 + weight) norm is a ~2x gain (four per layer, and Gemma
    # 3's q/k norms sharpen attention), and at 0.15 transformers' own bf16 logits stray 0.4-0.9 from its fp32 ones.
    "gemma2": dict(
        initializer_range=0.08,
        hidden_size=72,
        num_hidden_layers=3,
        tie_word_embeddings=True,
        query_pre_attn_scalar=24,
        sliding_window=8,
        attn_logit_softcapping=10.0,
        final_logit_softcapping=5.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "gemma3": dict(
        initializer_range=0.06,
        hidden_size=72,
        num_hidden_layers=3,
        tie_word_embeddings=True,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    ),
}


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of the tiny ``arch`` model (overrides win)."""
    if arch not in _CLASSES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHES}")
    config_cls, _ = _CLASSES[arch]
    return config_cls(**{**_BASE_CONFIG, **_ARCH_CONFIG[arch], **overrides})


def build_tiny_checkpoint(
    arch: str,
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    max_shard_size: Optional[str] = None,
    **overrides: Any,
) -> Path:
    """Write a seeded random tiny ``arch`` checkpoint (safetensors + generation_config) to ``out_dir``."""
    config = tiny_config(arch, **overrides)
    _, model_cls = _CLASSES[arch]
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.3)
    model = model.to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    GenerationConfig(
        bos_token_id=1, eos_token_id=EOS_TOKEN_ID, do_sample=True, temperature=0.7, top_p=0.9
    ).save_pretrained(out_dir)
    return out_dir


class TinyCheckpoints:
    """Builds each distinct tiny checkpoint once per test session under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def get(self, arch: str, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Path:
        """Path of the checkpoint for these arguments, building it on first use."""
        key = json.dumps([arch, str(dtype), kwargs], sort_keys=True, default=str)
        if key not in self._built:
            out_dir = self.root / f"{arch}-{len(self._built)}"
            self._built[key] = build_tiny_checkpoint(arch, out_dir, dtype, **kwargs)
        return self._built[key]


_SESSION_CACHES: dict[Path, TinyCheckpoints] = {}


def session_checkpoints(tmp_path_factory: Any) -> TinyCheckpoints:
    """The session-wide :class:`TinyCheckpoints` (shared by every test module that asks)."""
    root = tmp_path_factory.getbasetemp() / "tiny_checkpoints"
    if root not in _SESSION_CACHES:
        root.mkdir(parents=True, exist_ok=True)
        _SESSION_CACHES[root] = TinyCheckpoints(root)
    return _SESSION_CACHES[root]
