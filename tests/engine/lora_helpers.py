"""PEFT adapters for the tests, made by PEFT itself, and PEFT's greedy output as the reference.

PEFT initialises lora_B to zero (an adapter that changes nothing); these draw both A and B at random, so every
adapter moves the model's output and a wrongly applied one changes the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = ALL_TARGETS,
    seed: int = 0,
    scale: float = 0.1,
    **config: Any,
) -> Path:
    """Write a PEFT LoRA adapter of the model in ``base_dir`` with seeded random A and B (save_pretrained)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **config)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_model(base_dir: Path, adapter_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype, attn_implementation="sdpa")
    return PeftModel.from_pretrained(model, adapter_dir).eval()


def peft_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
