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
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHES = ("llama", "mistral", "qwen2", "qwen3")
EOS_TOKEN_ID = 2

_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
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
