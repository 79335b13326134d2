"""The engine's side of LoRA: which adapters are served under which names, and their weights in host memory.

Three tiers, as in S-LoRA: every *registered* adapter has a name and an id (a new id per load, so a name that is
unloaded and loaded again never shares prefix-cache blocks or a slot with its old weights); up to
``max_cpu_loras`` adapters' weights stay in host memory here (least recently used ones are dropped and read again
from disk when next needed); ``max_loras`` of them sit in the model's device slots, which the model runner owns
(:class:`pagoda.lora.slots.LoRASlots`). The scheduler keeps the adapters of one step within ``max_loras``, so a
step always finds its slots.

Loading and unloading run on any thread (the server's); the registry's lock is never held while files are read.
Every read of adapter files runs in a reader thread with a deadline (:mod:`pagoda.lora.reader`), and the engine
thread never waits for one: an adapter that host memory dropped is read again in the background while its requests
wait (the scheduler asks :meth:`LoRARegistry.ready`), and its requests fail, alone, if that read fails or runs out of
time. Unloading a name takes effect at once for new requests; requests already running on it finish on its
weights, which are released when the last of them ends.
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
from pagoda.lora.reader import AdapterReader, AdapterReadTimeout, Read
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


def unavailable_message(name: str) -> str:
    """What a request on an adapter whose files cannot be read is told (the details, paths among them, are for the
    log and an authorized ``GET /lora_adapters``)."""
    return f"LoRA adapter {name!r} is unavailable: its files could not be read; try again later"


class LoRARegistry:
    """Names, ids and host-memory weights of the adapters one engine serves; see the module docstring."""

    def __init__(
        self,
        targets: LoRATargets,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        download_dir: Optional[str] = None,
        read_timeout: float = 60.0,
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
        self.reader = AdapterReader(read_timeout)
        # engine thread only: reads of adapters host memory dropped, and ids whose read was refused at once
        self._rereads: dict[int, Read] = {}
        self._refused: dict[int, str] = {}
        # under the lock: why an adapter's files could not be read again (until a read succeeds), and the adapters
        # ready() found in host memory for the coming step, which no load may drop before the step has them
        self._read_errors: dict[int, str] = {}
        self._pinned: set[int] = set()

    # ---- any thread ---------------------------------------------------------------------------

    def load(self, module: LoRAModule, replace: bool = False) -> LoRARecord:
        """Download (if remote), read and check an adapter, then serve it under ``module.name``.

        ValueError (a LoRAAdapterError or ModelSourceError) when it cannot be served or the name is taken (unless
        ``replace``: the name then moves to the new adapter once it is read; the old one serves until then)."""
        with self._lock:
            self._check_name_free(module.name, replace)
        started = time.monotonic()
        folder = resolve_adapter_path(module.path, self.download_dir)
        adapter = self.reader.read(
            str(folder), f"LoRA adapter {module.name!r}", lambda: self._read(module.name, folder)
        )
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
            self._cache(record.lora_id, adapter, protected=self._pinned)
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
                self._read_errors.pop(lora_id, None)
        for lora_id in gone:  # a read still running for it is left to end alone
            self._rereads.pop(lora_id, None)
            self._refused.pop(lora_id, None)
        return gone

    def read_error(self, name: str) -> Optional[str]:
        """Why adapter ``name``'s files could not be read again, while that is so (None once a read succeeds)."""
        with self._lock:
            record = self._by_name.get(name)
            return None if record is None else self._read_errors.get(record.lora_id)

    def ready(self, lora_id: int) -> bool:
        """Whether a step can have ``lora_id``'s weights without reading a file: they are in host memory (and stay
        there until the next :meth:`fetch`). If host memory dropped them, a read starts in the background and this
        is False until it is done; :meth:`poll_reads` reports it if it fails."""
        with self._lock:
            record = self._records.get(lora_id)
            if lora_id in self._host or record is None:  # not loaded at all: fetch() fails its requests
                self._pinned.add(lora_id)
                return True
        if lora_id in self._rereads or lora_id in self._refused:
            return False
        what = f"LoRA adapter {record.name!r}"
        try:
            self._rereads[lora_id] = self.reader.start(
                record.local_path, what, lambda: self._read(record.name, Path(record.local_path))
            )
        except AdapterReadTimeout as exc:
            self._refused[lora_id] = str(exc)
        return False

    def poll_reads(self) -> dict[int, str]:
        """The background reads that failed or are past their deadline (id -> why): the requests waiting on those
        adapters must fail now. A read past its deadline is reported at every poll until it ends, so requests
        that arrive meanwhile fail at once instead of waiting on it."""
        failed, self._refused = self._refused, {}
        fresh = dict(failed)  # what is logged: new failures, not a stuck read at every step
        for lora_id, pending in list(self._rereads.items()):
            if pending.future.done():
                del self._rereads[lora_id]
                error = pending.future.exception()
                with self._lock:
                    if error is None and lora_id in self._records:
                        self._cache(lora_id, pending.future.result(), protected=self._pinned)
                        self._read_errors.pop(lora_id, None)
                if error is not None:
                    failed[lora_id] = fresh[lora_id] = (
                        f"LoRA adapter {self.name_of(lora_id)!r} could not be read again: {error}"
                    )
            elif pending.overdue(self.reader.timeout):
                failed[lora_id] = self.reader.timeout_message(f"LoRA adapter {self.name_of(lora_id)!r}", pending)
                if not pending.reported:
                    pending.reported, fresh[lora_id] = True, failed[lora_id]
        with self._lock:
            self._read_errors.update((i, m) for i, m in fresh.items() if i in self._records)
        for message in fresh.values():
            logger.warning("%s", message)
        return failed

    @property
    def awaiting_reads(self) -> bool:
        """Whether requests may be waiting on an adapter read (running, or finished or refused but not yet polled)."""
        return bool(self._rereads or self._refused)

    def pending_reads(self) -> list[Read]:
        """The background reads still running (the engine waits on them, briefly, when nothing else can run)."""
        return [r for r in self._rereads.values() if not r.future.done()]

    def fetch(self, missing: set[int], step_ids: set[int]) -> StepAdapters:
        """The weights of a step's adapters that are not in a device slot (``missing``), from host memory: the
        scheduler admitted only requests whose adapter :meth:`ready` found there, and pinned it. Never reads a
        file. ``step_ids`` (all of the step's adapters) are kept in host memory while the step copies them."""
        found = StepAdapters({}, {})
        with self._lock:
            for lora_id in missing:
                adapter = self._host.get(lora_id)
                if adapter is not None:
                    self._host.move_to_end(lora_id)
                    found.adapters[lora_id] = adapter  # held for the step: another thread's load may drop it now
                elif lora_id in self._records:
                    found.failed[lora_id] = unavailable_message(self._records[lora_id].name)
                else:
                    found.failed[lora_id] = f"LoRA adapter id {lora_id} is not loaded"
            self._pinned = set(step_ids)
        return found

    def _read(self, name: str, folder: Path) -> LoRAAdapter:
        """Runs in a reader thread."""
        return load_adapter(name, folder, self.targets, self.max_rank, self.dtype)

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
