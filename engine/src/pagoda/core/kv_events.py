"""KV cache events in vLLM's wire schema, and the collector the block pool appends them to.

The engine tells subscribers (a KV-aware router, an external cache index) which full blocks its prefix cache holds:
``BlockStored`` when blocks get their chain hash, ``BlockRemoved`` when a cached hash is evicted or withdrawn,
``AllBlocksCleared`` when the whole prefix cache is reset. Batches are encoded with MessagePack exactly as vLLM's
``msgspec`` structs in ``vllm/distributed/kv_events.py`` encode them in their positional form (``array_like=True,
omit_defaults=True``, events ``tag=True``)::

    KVEventBatch     = [ts: float64, events: [event, ...], data_parallel_rank: int]
    BlockStored      = ["BlockStored", block_hashes: [uint64], parent_block_hash: uint64 | nil,
                        token_ids: [int], block_size: int, lora_id: int | nil, medium: str | nil,
                        lora_name: str | nil]
    BlockRemoved     = ["BlockRemoved", block_hashes: [uint64], medium: str | nil]
    AllBlocksCleared = ["AllBlocksCleared"]

The fields vLLM added later with defaults (``extra_keys``, ``group_idx``, ``kv_cache_spec_*``) are never set here, so
``omit_defaults`` leaves them out. (vLLM after PR #42892 sends each *event* as a tagged map instead; consumers such as
llm-d's KV indexer and Dynamo read both forms, older ones only this one.)

Block hashes: Pagoda's chain hash is a 16-byte blake2b digest; on the wire it is what vLLM's ``ExternalBlockHash``
is by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest read as a big-endian integer, masked to its
low 64 bits (a uint64). The first block of a sequence has no parent (``nil``).

Hot path: the pool appends plain tuples of raw digests to :class:`KVEventCollector` (nothing when events are off:
the pool's collector is ``None``); :meth:`KVEventCollector.drain`, once per engine step, turns them into events, and
the publisher's thread encodes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import msgpack

MEDIUM_GPU = "GPU"  # vLLM's name of the engine's own KV cache (the tier routers score), whatever the device
_UINT64 = (1 << 64) - 1


def external_block_hash(digest: bytes) -> int:
    """The wire form of a chain hash (vLLM's default ``ExternalBlockHash``): low 64 bits, big-endian."""
    return int.from_bytes(digest, "big") & _UINT64


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one sequence entered the prefix cache; ``token_ids`` are all of theirs, in order."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = MEDIUM_GPU
    lora_name: Optional[str] = None

    def to_wire(self) -> list[Any]:
        return [
            "BlockStored",
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.lora_id,
            self.medium,
            self.lora_name,
        ]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted (their slots reused) or withdrawn (their KV was never written)."""

    block_hashes: list[int]
    medium: Optional[str] = MEDIUM_GPU

    def to_wire(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    def to_wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one engine step, stamped with wall-clock time (seconds since the epoch)."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: Optional[int] = None

    def to_wire(self) -> list[Any]:
        wire: list[Any] = [self.ts, [event.to_wire() for event in self.events]]
        if self.data_parallel_rank is not None:  # omit_defaults: a None rank is not sent
            wire.append(self.data_parallel_rank)
        return wire

    def encode(self) -> bytes:
        """The MessagePack payload (the third frame of a published message)."""
        return msgpack.packb(self.to_wire(), use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload of :meth:`KVEventBatch.encode` (or of vLLM's positional form) back into a batch; ValueError when
    it is not one."""
    wire = msgpack.unpackb(payload, raw=False)
    if not isinstance(wire, list) or len(wire) not in (2, 3):
        raise ValueError(f"not a KV event batch: {wire!r:.200}")
    return KVEventBatch(float(wire[0]), [_decode_event(e) for e in wire[1]], wire[2] if len(wire) == 3 else None)


def _decode_event(wire: Any) -> KVCacheEvent:
    if not isinstance(wire, list) or not wire:
        raise ValueError(f"not a KV event: {wire!r:.200}")
    tag, fields = wire[0], wire[1:]
    if tag == "BlockStored" and len(fields) >= 4:
        return BlockStored(*fields[:7])
    if tag == "BlockRemoved" and len(fields) >= 1:
        return BlockRemoved(*fields[:2])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event {tag!r}")


# Log entries: (kind, ...) tuples of raw digests, cheap to append; drain() builds the events.
_STORED, _REMOVED, _CLEARED = 0, 1, 2


class KVEventCollector:
    """What the block pool and the KV cache manager append to during a step; drained once per step."""

    __slots__ = ("_log", "block_size", "lora_name_of")

    def __init__(self, block_size: int, lora_name_of: Optional[Callable[[int], Optional[str]]] = None) -> None:
        self._log: list[tuple] = []
        self.block_size = block_size
        self.lora_name_of = lora_name_of  # LoRA id -> adapter name, resolved when the blocks are stored

    def stored(
        self, digests: Sequence[bytes], parent: Optional[bytes], token_ids: list[int], lora_id: Optional[int]
    ) -> None:
        """``digests`` (consecutive blocks, ``parent`` the one before the first) got cached with ``token_ids``."""
        name = None
        if lora_id is not None and self.lora_name_of is not None:
            name = self.lora_name_of(lora_id)
        self._log.append((_STORED, digests, parent, token_ids, lora_id, name))

    def removed(self, digest: bytes) -> None:
        self._log.append((_REMOVED, digest))

    def cleared(self) -> None:
        self._log.append((_CLEARED,))

    def __len__(self) -> int:
        return len(self._log)

    def drain(self) -> list[KVCacheEvent]:
        """The events logged since the last drain, in order (adjacent removals merged into one event)."""
        log, self._log = self._log, []
        events: list[KVCacheEvent] = []
        for entry in log:
            kind = entry[0]
            if kind == _REMOVED:
                digest = external_block_hash(entry[1])
                if events and isinstance(events[-1], BlockRemoved):
                    events[-1].block_hashes.append(digest)
                else:
                    events.append(BlockRemoved([digest]))
            elif kind == _STORED:
                _, digests, parent, token_ids, lora_id, name = entry
                events.append(
                    BlockStored(
                        [external_block_hash(d) for d in digests],
                        None if parent is None else external_block_hash(parent),
                        token_ids,
                        self.block_size,
                        lora_id,
                        MEDIUM_GPU,
                        name,
                    )
                )
            else:
                events.append(AllBlocksCleared())
        return events

    def drain_batch(self, data_parallel_rank: int = 0) -> Optional[KVEventBatch]:
        """This step's events as one batch, or None when there were none (empty batches are not published)."""
        if not self._log:
            return None
        return KVEventBatch(time.time(), self.drain(), data_parallel_rank)
