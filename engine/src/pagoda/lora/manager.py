"""The adapters an engine serves: names, host-memory cache, device slots, and each step's segments.

Three tiers, as in S-LoRA: every *registered* adapter has a name and an id (a new id per load, so a name that is
unloaded and loaded again never shares prefix-cache blocks or a slot with its old weights); up to
``max_cpu_loras`` adapters' weights stay in host memory (least recently used ones are dropped and read again from
disk when next needed); ``max_loras`` of them sit in the model's slots (least recently used slot reused). The
scheduler keeps the adapters of one step within ``max_loras``, so a step always finds its slots.

Loading and unloading run on any thread (the server's); slot changes run on the engine thread, between steps.
Unloading a name takes effect at once for new requests; requests already running on it finish on its weights,
which are released when the last of them ends.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pagoda.layers import Linear, MergedLinear
from pagoda.lora.adapter import PROJECTIONS, LoRAAdapter, load_adapter
from pagoda.lora.layers import LinearLoRA, LoRAContext, LoRASegments, default_mode
from pagoda.lora.sources import LoRAModule, resolve_adapter_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoRASettings:
    """The engine's LoRA flags: slots, their width, the host cache, and where remote adapters download to."""

    max_loras: int
    max_rank: int
    max_cpu_loras: Optional[int] = None  # None: max_loras
    download_dir: Optional[str] = None


@dataclass(frozen=True, slots=True)
class LoRARecord:
    """A loaded adapter: ``lora_id`` is unique for the engine's life."""

    lora_id: int
    name: str
    path: str  # as given (a Hub id, s3:// URL or folder)
    local_path: str
    base_model_name: Optional[str]
    rank: int
    created: int


class LoRAManager:
    """Owns the LoRA slots of one model; see the module docstring for the tiers."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: Optional[int],
        dtype: torch.dtype,
        device: torch.device,
        download_dir: Optional[str] = None,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.dtype = dtype
        self.device = device
        self.download_dir = download_dir
        self.context = LoRAContext()
        self.mode = default_mode(device)
        self.layers = _wrap_layers(model, self.context, max_loras, max_rank, dtype, device, self.mode)
        self.targets = {name: (layer.in_features, layer.output_slices) for name, layer in self.layers.items()}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._by_name: dict[str, LoRARecord] = {}
        self._records: dict[int, LoRARecord] = {}  # registered, or unloaded but still used by a request
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU: most recent last
        self._slot_of: dict[int, int] = {}  # lora id -> slot (engine thread only)
        self._slot_lru: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))
        self._step_adapters: dict[int, LoRAAdapter] = {}  # the current step's adapters (engine thread)

    # ---- registry (any thread) ------------------------------------------------------------

    def load(self, module: LoRAModule, replace: bool = False) -> LoRARecord:
        """Download (if remote), read and check an adapter, then serve it under ``module.name``.

        ValueError (a LoRAAdapterError or ModelSourceError) when it cannot be served or the name is taken (unless
        ``replace``: the name then moves to the new adapter once it is read; the old one serves until then)."""
        with self._lock:
            if module.name in self._by_name and not replace:
                raise ValueError(f"LoRA adapter {module.name!r} is already loaded; unload it first")
        started = time.monotonic()
        folder = resolve_adapter_path(module.path, self.download_dir)
        adapter = load_adapter(module.name, folder, self.targets, self.max_rank, self.dtype)
        with self._lock:
            if module.name in self._by_name and not replace:
                raise ValueError(f"LoRA adapter {module.name!r} is already loaded; unload it first")
            record = LoRARecord(
                next(self._ids),
                module.name,
                module.path,
                str(folder),
                module.base_model_name,
                adapter.rank,
                int(time.time()),
            )
            self._by_name[module.name] = record
            self._records[record.lora_id] = record
            self._cache(record.lora_id, adapter, protected=set())
        logger.info(
            "LoRA adapter %s loaded from %s (id %d, rank %d, %.1f MiB, %.2f s)",
            module.name, module.path, record.lora_id, adapter.rank, adapter.num_bytes / 2**20, time.monotonic() - started,
        )  # fmt: skip
        return record

    def unload(self, name: str) -> LoRARecord:
        """Stop serving ``name`` to new requests (KeyError if it is not loaded); its weights go once unused."""
        with self._lock:
            record = self._by_name.pop(name)
        logger.info("LoRA adapter %s unloaded (id %d)", name, record.lora_id)
        return record

    def lookup(self, name: str) -> Optional[LoRARecord]:
        with self._lock:
            return self._by_name.get(name)

    def loaded(self) -> list[LoRARecord]:
        """The adapters new requests can use, in load order."""
        with self._lock:
            return sorted(self._by_name.values(), key=lambda r: r.lora_id)

    def name_of(self, lora_id: int) -> str:
        with self._lock:
            record = self._records.get(lora_id)
        return record.name if record is not None else str(lora_id)

    # ---- engine thread ----------------------------------------------------------------------

    @property
    def has_unloaded_in_use(self) -> bool:
        """Whether some unloaded adapter's weights are still kept (for requests that were running on it)."""
        with self._lock:
            return len(self._records) > len(self._by_name)

    def release_unused(self, in_use: set[int]) -> None:
        """Forget unloaded adapters that no request uses any more (host weights and slot)."""
        with self._lock:
            live = {r.lora_id for r in self._by_name.values()} | in_use
            gone = [lora_id for lora_id in self._records if lora_id not in live]
            for lora_id in gone:
                del self._records[lora_id]
                self._host.pop(lora_id, None)
        for lora_id in gone:
            slot = self._slot_of.pop(lora_id, None)
            if slot is not None:
                for layer in self.layers.values():
                    layer.set_slot(slot, None)
                self._slot_lru.move_to_end(slot, last=False)  # reused first

    def fetch(self, lora_ids: set[int]) -> dict[int, str]:
        """Have every adapter of a step that is not in a slot in host memory (reading dropped ones again from disk)
        and hold them for the step's slot changes; returns the ids that could not be read, with why. Their
        requests must fail: the step cannot run them."""
        failed: dict[int, str] = {}
        self._step_adapters = {}
        for lora_id in lora_ids:
            if lora_id in self._slot_of:  # in a slot already: its weights are on the device
                continue
            with self._lock:
                adapter = self._host.get(lora_id)
                if adapter is not None:
                    self._host.move_to_end(lora_id)
                record = self._records.get(lora_id)
            if adapter is None and record is None:
                failed[lora_id] = f"LoRA adapter id {lora_id} is not loaded"
                continue
            if adapter is None:
                try:
                    adapter = load_adapter(
                        record.name, Path(record.local_path), self.targets, self.max_rank, self.dtype
                    )
                except Exception as exc:  # the folder changed or vanished: its requests fail, the engine goes on
                    failed[lora_id] = (
                        f"LoRA adapter {record.name!r} could not be read again from {record.local_path}: {exc}"
                    )
                    continue
                with self._lock:
                    self._cache(lora_id, adapter, protected=lora_ids)
            # held here for _slot: a load on another thread may drop it from the host cache meanwhile
            self._step_adapters[lora_id] = adapter
        return failed

    def prepare_step(self, runs: list[tuple[Optional[int], int, int]], kept_runs: Optional[list]) -> None:
        """Put the step's adapters in slots and set the segments every wrapped layer reads.

        ``runs``: (lora id or None, first row, end row) over the flat batch, ordered so each id's rows are one run;
        ``kept_runs``: the same over the rows the last layer keeps (None when it keeps all)."""
        ids = {lora_id for lora_id, _, _ in runs if lora_id is not None}
        assert len(ids) <= self.max_loras, f"the scheduler put {len(ids)} adapters in one step (max {self.max_loras})"
        slots = {lora_id: self._slot(lora_id, ids) for lora_id in ids}
        self.context.full = self._segments(runs, slots)
        self.context.kept = self._segments(kept_runs, slots) if kept_runs is not None else None

    def clear_step(self) -> None:
        self.context.full = self.context.kept = None
        self._step_adapters = {}

    def slot_order(self, lora_id: Optional[int]) -> int:
        """Sort key that groups a step's rows by adapter (base-model rows first)."""
        return -1 if lora_id is None else lora_id

    def _slot(self, lora_id: int, step_ids: set[int]) -> int:
        slot = self._slot_of.get(lora_id)
        if slot is None:
            slot = next(s for s in self._slot_lru if not any(self._slot_of.get(i) == s for i in step_ids))
            for old_id, old_slot in list(self._slot_of.items()):
                if old_slot == slot:
                    del self._slot_of[old_id]
            adapter = self._step_adapters[lora_id]  # fetch() ran for this step
            for name, layer in self.layers.items():
                layer.set_slot(slot, adapter.weights.get(name))
            self._slot_of[lora_id] = slot
            logger.debug("LoRA adapter %s now in slot %d", adapter.name, slot)
        self._slot_lru.move_to_end(slot)
        return slot

    def _segments(self, runs: list[tuple[Optional[int], int, int]], slots: dict[int, int]) -> Optional[LoRASegments]:
        num_rows = runs[-1][2] if runs else 0
        slot_runs = [(slots[i], start, end) for i, start, end in runs if i is not None and end > start]
        if not slot_runs:
            return None
        segments = LoRASegments(num_rows, slot_runs)
        if self.mode == "triton":
            segments.device_mapping = device_mapping(slot_runs, num_rows, self.max_loras, self.device)
        return segments

    def _cache(self, lora_id: int, adapter: LoRAAdapter, protected: set[int]) -> None:
        """Keep ``adapter`` in host memory, dropping the least recently used others beyond ``max_cpu_loras``."""
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        for old in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                break
            if old != lora_id and old not in protected:
                del self._host[old]


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
