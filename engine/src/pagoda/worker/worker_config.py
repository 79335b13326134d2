"""What one rank needs to build its part of the model: plain, frozen, picklable (sent to spawned ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pagoda.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class LoRASlotConfig:
    """The device side of LoRA: how many adapters one step may hold, and how wide their slots are."""

    max_loras: int
    max_rank: int


@dataclass(frozen=True)
class WorkerConfig:
    """One rank's model, dtype, device kind, attention backend and cache dtype (the same on every rank)."""

    model_config: ModelConfig
    model_path: Path
    dtype: torch.dtype
    device_type: str  # cpu | cuda (rank r uses cuda:r)
    attention_backend: str  # resolved: torch | triton
    quantization: Optional[str] = None
    kv_cache_dtype: str = "auto"  # auto | fp8_e4m3 | fp8_e5m2
    lora: Optional[LoRASlotConfig] = None  # None: LoRA is off
