"""The model runner's side of LoRA: ``max_loras`` device slots in every wrapped layer, and each step's segments.

The engine's :class:`~pagoda.lora.registry.LoRARegistry` hands over the weights of the adapters a step needs that
no slot holds; this class puts them in slots (the least recently used slot not needed by the step is reused) and
tells every wrapped layer which rows of the flat batch run on which slot. Engine thread only.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Optional

import torch
from torch import nn

from pagoda.layers import Linear, MergedLinear
from pagoda.lora.adapter import PROJECTIONS, LoRAAdapter
from pagoda.lora.layers import LinearLoRA, LoRAContext, LoRASegments, default_mode

logger = logging.getLogger(__name__)

# (lora id or None for the base model, first row, end row) over a step's rows
LoRARun = tuple[Optional[int], int, int]


class LoRASlots:
    """The device slots of one model's wrapped layers and the current step's segments."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras = max_loras
        self.device = device
        self.context = LoRAContext()
        self.mode = default_mode(device)
        self.layers = _wrap_layers(model, self.context, max_loras, max_rank, dtype, device, self.mode)
        self._slot_of: dict[int, int] = {}  # lora id -> slot
        self._slot_lru: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))

    @property
    def targets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """layer name -> (in_features, output slices): what an adapter's tensors must fit."""
        return {name: (layer.in_features, layer.output_slices) for name, layer in self.layers.items()}

    def resident(self) -> frozenset[int]:
        """The adapters whose weights are in a slot now."""
        return frozenset(self._slot_of)

    def remove(self, lora_ids: list[int]) -> None:
        """Empty the slots of adapters nobody serves any more (their slots are reused first)."""
        for lora_id in lora_ids:
            slot = self._slot_of.pop(lora_id, None)
            if slot is not None:
                for layer in self.layers.values():
                    layer.set_slot(slot, None)
                self._slot_lru.move_to_end(slot, last=False)

    def prepare_step(
        self, runs: list[LoRARun], kept_runs: Optional[list[LoRARun]], adapters: Mapping[int, LoRAAdapter]
    ) -> None:
        """Put the step's adapters in slots and set the segments every wrapped layer reads.

        ``runs``: over the flat batch, ordered so each id's rows are one run; ``kept_runs``: the same over the rows
        the last layer keeps (None when it keeps all); ``adapters``: the weights of every id of ``runs`` that no
        slot holds (the others may be absent)."""
        ids = {lora_id for lora_id, _, _ in runs if lora_id is not None}
        assert len(ids) <= self.max_loras, f"the scheduler put {len(ids)} adapters in one step (max {self.max_loras})"
        slots = {lora_id: self._slot(lora_id, ids, adapters) for lora_id in ids}
        self.context.full = self._segments(runs, slots)
        self.context.kept = self._segments(kept_runs, slots) if kept_runs is not None else None

    def clear_step(self) -> None:
        self.context.full = self.context.kept = None

    @property
    def step_has_adapters(self) -> bool:
        """Whether some row of the current step runs on an adapter (CUDA graphs hold no adapter rows)."""
        return self.context.full is not None

    @staticmethod
    def slot_order(lora_id: Optional[int]) -> int:
        """Sort key that groups a step's rows by adapter (base-model rows first)."""
        return -1 if lora_id is None else lora_id

    def _slot(self, lora_id: int, step_ids: set[int], adapters: Mapping[int, LoRAAdapter]) -> int:
        slot = self._slot_of.get(lora_id)
        if slot is None:
            slot = next(s for s in self._slot_lru if not any(self._slot_of.get(i) == s for i in step_ids))
            for old_id, old_slot in list(self._slot_of.items()):
                if old_slot == slot:
                    del self._slot_of[old_id]
            adapter = adapters[lora_id]  # the registry fetched every id no slot holds
            for name, layer in self.layers.items():
                layer.set_slot(slot, adapter.weights.get(name))
            self._slot_of[lora_id] = slot
            logger.debug("LoRA adapter %s now in slot %d", adapter.name, slot)
        self._slot_lru.move_to_end(slot)
        return slot

    def _segments(self, runs: list[LoRARun], slots: dict[int, int]) -> Optional[LoRASegments]:
        num_rows = runs[-1][2] if runs else 0
        slot_runs = [(slots[i], start, end) for i, start, end in runs if i is not None and end > start]
        if not slot_runs:
            return None
        segments = LoRASegments(num_rows, slot_runs)
        if self.mode == "triton":
            segments.device_mapping = device_mapping(slot_runs, num_rows, self.max_loras, self.device)
        return segments


def _wrap_layers(
    model: nn.Module,
    context: LoRAContext,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    mode: str,
) -> dict[str, LinearLoRA]:
    """Give every decoder layer's q/k/v, o, gate/up and down projection its slots; keyed ``layers.{i}.{module}``."""
    wrapped: dict[str, LinearLoRA] = {}
    modules = {suffix for suffix, _ in PROJECTIONS.values()}
    for index, layer in enumerate(model.model.layers):
        for suffix in sorted(modules):
            if suffix.startswith("mlp.") and not hasattr(layer.mlp, suffix.split(".", 1)[1]):
                continue  # a mixture-of-experts layer has no dense MLP: adapters naming it are refused at load
            linear = layer.get_submodule(suffix)
            assert isinstance(linear, Linear), f"{suffix} of layer {index} is not a Linear"
            slices = linear.output_sizes if isinstance(linear, MergedLinear) else (linear.out_features,)
            linear.lora = LinearLoRA(context, linear.in_features, slices, max_loras, max_rank, dtype, device, mode)
            wrapped[f"layers.{index}.{suffix}"] = linear.lora
    return wrapped


def device_mapping(
    runs: list[tuple[int, int, int]], num_rows: int, max_loras: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted token ids [num_rows], segment starts [max_loras + 1], segment slots [max_loras]) as int32."""
    sorted_ids = list(itertools.chain.from_iterable(range(start, end) for _, start, end in runs))
    starts, total = [0], 0
    for _, start, end in runs:
        total += end - start
        starts.append(total)
    starts += [total] * (max_loras + 1 - len(starts))
    slots = [slot for slot, _, _ in runs] + [-1] * (max_loras - len(runs))
    sorted_ids += [0] * (num_rows - len(sorted_ids))

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return tensor(sorted_ids), tensor(starts), tensor(slots)
