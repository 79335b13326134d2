"""Tiny random gpt-oss checkpoints, written by transformers' own GptOssConfig / GptOssForCausalLM.

Two forms, both in the layout the Hub checkpoints have:

- dense (``build_gpt_oss_checkpoint``): ``save_pretrained`` of the random model; the experts are the fused,
  transposed ``mlp.experts.gate_up_proj`` [E, hidden, 2 * inter] (gate/up columns interleaved) and ``down_proj``
  [E, inter, hidden], as in the bf16 releases;
- MXFP4 (``build_gpt_oss_mxfp4_checkpoint``): the published openai/gpt-oss layout, the experts' weights replaced by
  ``<proj>_blocks`` (uint8 [E, out, in / 32, 16]) and ``<proj>_scales`` (uint8 [E, out, in / 32]), biases kept, and
  ``quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`` as openai writes it. The random
  expert weights are rounded to MXFP4 first, and a dense checkpoint of exactly the dequantized weights is written
  beside it as transformers' reference (transformers itself reads MXFP4 only through its GPU kernels).

As in :mod:`tiny_checkpoints`, ``initializer_range`` is 0.15 and norms, biases and the sinks are randomised, so that
a tensor loaded into the wrong place changes the output. The sliding window is 8, so that prompts of 20+ tokens
reach past it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

from pagoda.quantization.mxfp4 import dequantize_mxfp4, quantize_mxfp4

EOS_TOKEN_ID = 2
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 128,
}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 150000.0}
# what openai/gpt-oss-20b's config.json leaves unquantized
MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]

_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,  # a multiple of 32 per rank at TP=2: MXFP4 blocks shard whole
    num_hidden_layers=3,  # sliding, full, sliding
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=0,
    tie_word_embeddings=False,
    rope_parameters=YARN,
)


def _random_model(seed: int, **overrides: Any) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**{**_CONFIG, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
            elif name.endswith("bias"):  # q/k/v/o, router and expert biases
                param.normal_(0.0, 0.3)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    return model


def _save(model: GptOssForCausalLM, out_dir: Path, dtype: torch.dtype) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out_dir)
    GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_ID).save_pretrained(out_dir)
    return out_dir


def build_gpt_oss_checkpoint(
    out_dir: Path, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any
) -> Path:
    """A dense tiny gpt-oss checkpoint (transformers' ``save_pretrained``) in ``out_dir``."""
    return _save(_random_model(seed, **overrides), out_dir, dtype)


def build_gpt_oss_mxfp4_checkpoint(root: Path, seed: int = 0, **overrides: Any) -> tuple[Path, Path]:
    """(MXFP4 checkpoint in the published layout, dense float32 checkpoint of its dequantized weights) under
    ``root``. The MXFP4 one's non-expert tensors are bf16, as published; the reference holds the same values."""
    model = _random_model(seed, **overrides).to(torch.bfloat16)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantize_mxfp4(param.float().transpose(1, 2))  # rows = outputs: [E, out, in]
                packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
                param.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))  # exact in bf16
    reference = _save(model, root / "dequantized", torch.float32)
    out_dir = root / "mxfp4"
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    save_file({**tensors, **packed}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((reference / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_NOT_CONVERTED}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_ID).save_pretrained(out_dir)
    return out_dir, reference
