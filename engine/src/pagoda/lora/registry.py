"""The engine's side of LoRA: which adapters are served under which names, and their weights in host memory.

Three tiers, as in S-LoRA: every *registered* adapter has a name and an id (a new id per load, so a name that is
unloaded and loaded again never shares prefix-cache blocks or a slot with its old weights); up to
``max_cpu_loras`` adapters' weights stay in host memory here (least recently used ones are dropped and read again
from disk when next needed); ``max_loras`` of them sit in the model's device slots, which the model runner owns
(:class:`pagoda.lora.slots.LoRASlots`). The scheduler keeps the adapters of one step within ``max_loras``, so a
step always finds its slots.

Loading and unloading run on any thread (the server's), under this registry's lock; the engine thread asks for a
step's adapters between steps. Unloading a name takes effect at once for new requests; requests already running
on it finish on its weights, which are released when the last of them ends.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pagoda.lora.adapter import LoRAAdapter, load_adapter
from pagoda.lora.sources import LoRAModule, resolve_adapter_path

logger = logging.getLogger(__name__)

# layer name -> (in_features, output slices): what an adapter's tensors must fit (see LoRASlots.targets)
LoRATargets = Mapping[str, tuple[int, tuple[int, ...]]]


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


@dataclass(slots=True)
class StepAdapters:
    """What the registry found for a step: the weights of the adapters the device slots lack, and the ids that
    could not be read (with why): their requests must fail, the step cannot run them."""

    adapters: dict[int, LoRAAdapter]
    failed: dict[int, str]


class LoRARegistry:
    """Names, ids and host-memory weights of the adapters one engine serves; see the module docstring."""

    def __init__(
        self,
        targets: LoRATargets,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        download_dir: Optional[str] = None,
    ) -> None:
        self.targets = dict(targets)
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.download_dir = download_dir
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._by_name: dict[str, LoRARecord] = {}
        self._records: dict[int, LoRARecord] = {}  # registered, or unloaded but still used by a request
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU: most recent last

    # ---- any thread ---------------------------------------------------------------------------

    def load(self, module: LoRAModule, replace: bool = False) -> LoRARecord:
        """Download (if remote), read and check an adapter, then serve it under ``module.name``.

        ValueError (a LoRAAdapterError or ModelSourceError) when it cannot be served or the name is taken (unless
        ``replace``: the name then moves to the new adapter once it is read; the old one serves until then)."""
        with self._lock:
            self._check_name_free(module.name, replace)
        started = time.monotonic()
        folder = resolve_adapter_path(module.path, self.download_dir)
        adapter = load_adapter(module.name, folder, self.targets, self.max_rank, self.dtype)
        with self._lock:
            self._check_name_free(module.name, replace)
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

    # ---- engine thread --------------------------------------------------------------------------

    @property
    def has_unloaded_in_use(self) -> bool:
        """Whether some unloaded adapter's weights are still kept (for requests that were running on it)."""
        with self._lock:
            return len(self._records) > len(self._by_name)

    def release_unused(self, in_use: set[int]) -> list[int]:
        """Forget unloaded adapters that no request uses any more; returns their ids (their slots go too)."""
        with self._lock:
            live = {r.lora_id for r in self._by_name.values()} | in_use
            gone = [lora_id for lora_id in self._records if lora_id not in live]
            for lora_id in gone:
                del self._records[lora_id]
                self._host.pop(lora_id, None)
        return gone

    def fetch(self, missing: set[int], step_ids: set[int]) -> StepAdapters:
        """The weights of a step's adapters that are not in a device slot (``missing``), from host memory or read
        again from disk when host memory dropped them. ``step_ids`` (all of the step's adapters) stay in host
        memory while others are read."""
        found = StepAdapters({}, {})
        for lora_id in missing:
            with self._lock:
                adapter = self._host.get(lora_id)
                if adapter is not None:
                    self._host.move_to_end(lora_id)
                record = self._records.get(lora_id)
            if adapter is None and record is None:
                found.failed[lora_id] = f"LoRA adapter id {lora_id} is not loaded"
                continue
            if adapter is None:
                try:
                    adapter = load_adapter(
                        record.name, Path(record.local_path), self.targets, self.max_rank, self.dtype
                    )
                except Exception as exc:  # the folder changed or vanished: its requests fail, the engine goes on
                    found.failed[lora_id] = (
                        f"LoRA adapter {record.name!r} could not be read again from {record.local_path}: {exc}"
                    )
                    continue
                with self._lock:
                    self._cache(lora_id, adapter, protected=step_ids)
            # held for the step: a load on another thread may drop it from the host cache meanwhile
            found.adapters[lora_id] = adapter
        return found

    # ---- helpers (under the lock) ----------------------------------------------------------------

    def _check_name_free(self, name: str, replace: bool) -> None:
        if name in self._by_name and not replace:
            raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")

    def _cache(self, lora_id: int, adapter: LoRAAdapter, protected: set[int]) -> None:
        """Keep ``adapter`` in host memory, dropping the least recently used others beyond ``max_cpu_loras``."""
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        for old in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                break
            if old != lora_id and old not in protected:
                del self._host[old]
