"""LoRA adapters: PEFT checkpoints read onto the model's layers, batched per step over fixed slots.

The engine keeps names, ids and host-memory weights (:mod:`pagoda.lora.registry`); the model runner keeps the
device slots and each step's segments (:mod:`pagoda.lora.slots`); :mod:`pagoda.lora.layers` is the batched forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's handle for running a request on an adapter: ``LLM.generate(..., lora_request=LoRARequest(...))``
    loads the adapter under ``lora_name`` on first use. ``lora_int_id`` is accepted for vLLM's signature; the
    engine assigns its own ids."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: Optional[str] = None
