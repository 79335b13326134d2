"""Which token blocks each endpoint's KV cache holds, from the engine's KV cache events (vLLM's wire format).

An engine publishes batches of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events. Its block hashes
cannot be recomputed outside the engine (they depend on its hash function and seed), so the index gives every stored
block a router-side chain key instead: ``key = blake2b_8(parent key || lora || the block's token ids)``, computed from
the ``token_ids`` and ``parent_block_hash`` of ``BlockStored`` (the parent's engine hash is looked up in the blocks
the endpoint already stored). A request's token ids chain the same way, so "how many leading blocks of this request
does the endpoint hold" is a walk down its keys.

Decoded batches come in either layout vLLM has used: the array layout (``[ts, events, dp_rank?]``, each event
``[tag, field, ...]`` in declaration order, trailing defaults omitted) or the map layout (``{"ts", "events"}``, each
event ``{"type": tag, field: value}``). Unknown events and malformed ones are skipped, never raised.
"""

from __future__ import annotations

import json
import logging
import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any, Optional

log = logging.getLogger(__name__)

# Field order of each event in the array layout (vllm/distributed/kv_events.py), after the tag.
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _root(lora: Optional[str]) -> bytes:
    """The chain's seed: blocks computed under an adapter never match the base model's."""
    return b"" if not lora else b"lora\x00" + lora.encode("utf-8")


def _next_key(parent: bytes, tokens: Sequence[int], extra: Any = None) -> bytes:
    data = parent + struct.pack(f"<{len(tokens)}q", *tokens)
    if extra is not None:  # multimodal hashes, cache salt: the tokens alone do not say what the block holds
        data += json.dumps(extra, default=repr).encode("utf-8")
    return blake2b(data, digest_size=8).digest()


def chain_keys(token_ids: Sequence[int], block_size: int, lora: Optional[str] = None) -> list[bytes]:
    """The router-side chain keys of each full ``block_size`` block of ``token_ids``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    keys, parent = [], _root(lora)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _next_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


def _event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    """(tag, fields by name) of one decoded event in either layout; ("", {}) when it is neither."""
    if isinstance(event, Mapping):
        tag = event.get("type")
        return (tag, dict(event)) if isinstance(tag, str) else ("", {})
    if isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        names = _FIELDS.get(event[0], ())
        return event[0], dict(zip(names, event[1:], strict=False))
    return "", {}


@dataclass(slots=True)
class _Blocks:
    """One endpoint's blocks: engine hash -> (chain key or None when its chain is unknown, where it is stored)."""

    blocks: dict[Any, tuple[Optional[bytes], set[tuple[Any, Any]]]] = field(default_factory=dict)
    chains: Counter[bytes] = field(default_factory=Counter)
    block_size: Optional[int] = None
    generation: int = 0

    def store(self, fields: dict[str, Any]) -> None:
        hashes, tokens, size = fields["block_hashes"], fields["token_ids"], int(fields["block_size"])
        lora = fields.get("lora_name")
        if lora is not None and not isinstance(lora, str):
            raise TypeError(f"lora_name {lora!r} is not a string")
        if not lora and fields.get("lora_id") is not None:  # older engines name adapters by id only
            lora = f"#{fields['lora_id']}"
        extras = fields.get("extra_keys") or [None] * len(hashes)
        parent_hash = fields.get("parent_block_hash")
        parent = _root(lora) if parent_hash is None else self.blocks.get(_hashable(parent_hash), (None,))[0]
        place = _place(fields)
        self.block_size = size
        for number, engine_hash in enumerate(hashes):
            block = tokens[number * size : (number + 1) * size]
            known = parent is not None and len(block) == size
            key = _next_key(parent, block, extras[number] if number < len(extras) else None) if known else None
            self._add(_hashable(engine_hash), key, place)
            parent = key

    def _add(self, engine_hash: Any, key: Optional[bytes], place: tuple[Any, Any]) -> None:
        entry = self.blocks.get(engine_hash)
        if entry is None:
            self.blocks[engine_hash] = (key, {place})
            if key is not None:
                self.chains[key] += 1
        else:
            entry[1].add(place)

    def remove(self, fields: dict[str, Any]) -> None:
        place = _place(fields)
        for engine_hash in fields["block_hashes"]:
            entry = self.blocks.get(_hashable(engine_hash))
            if entry is None:
                continue
            entry[1].discard(place)
            if not entry[1]:  # gone from every medium
                del self.blocks[_hashable(engine_hash)]
                if entry[0] is not None:
                    self.chains[entry[0]] -= 1
                    if self.chains[entry[0]] <= 0:
                        del self.chains[entry[0]]

    def clear(self) -> None:
        self.blocks.clear()
        self.chains.clear()
        self.generation += 1


def _place(fields: dict[str, Any]) -> tuple[Any, Any]:
    """Where a block is: (KV cache group, medium); engines from before media existed meant the GPU."""
    return fields.get("group_idx"), fields.get("medium") or "GPU"


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class KVIndex:
    """Which token-block chains each endpoint holds, from its KV events (BlockStored/BlockRemoved/AllBlocksCleared)."""

    def __init__(self) -> None:
        self._endpoints: dict[str, _Blocks] = {}

    def apply(self, key: str, batch: Any) -> None:
        """Apply one decoded EventBatch (array or map layout) from endpoint ``key``; malformed events are skipped."""
        events = batch.get("events") if isinstance(batch, Mapping) else None
        if isinstance(batch, (list, tuple)) and len(batch) >= 2:
            events = batch[1]
        if not isinstance(events, (list, tuple)):
            log.debug("KV event batch from %s without events: %.200r", key, batch)
            return
        blocks = self._endpoints.setdefault(key, _Blocks())
        for event in events:
            tag, fields = _event_fields(event)
            try:
                if tag == "BlockStored":
                    blocks.store(fields)
                elif tag == "BlockRemoved":
                    blocks.remove(fields)
                elif tag == "AllBlocksCleared":
                    blocks.clear()
            except (KeyError, TypeError, ValueError, struct.error, AttributeError, OverflowError) as error:
                log.debug("skipping malformed KV event from %s (%s): %.200r", key, error, event)

    def clear(self, key: str) -> None:
        """Forget what endpoint ``key`` holds (its engine restarted, or cleared its cache); counts as a clear."""
        blocks = self._endpoints.get(key)
        if blocks is not None:
            blocks.clear()

    def forget(self, key: str) -> None:
        """The endpoint is gone: drop it entirely."""
        self._endpoints.pop(key, None)

    def num_blocks(self, key: str) -> int:
        """How many distinct blocks (engine hashes, on any medium) the endpoint holds."""
        blocks = self._endpoints.get(key)
        return len(blocks.blocks) if blocks is not None else 0

    def known(self, key: str) -> bool:
        """Whether any batch from the endpoint was applied (an endpoint without events says nothing by holding 0)."""
        return key in self._endpoints

    def generation(self, key: str) -> int:
        """How many times the endpoint's blocks were all cleared (AllBlocksCleared, or ``clear``)."""
        blocks = self._endpoints.get(key)
        return blocks.generation if blocks is not None else 0

    def block_size(self, key: str) -> Optional[int]:
        """The block size of the endpoint's last BlockStored event, None before one."""
        blocks = self._endpoints.get(key)
        return blocks.block_size if blocks is not None else None

    def match_keys(self, key: str, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (from ``chain_keys``), from the first on, the endpoint holds."""
        blocks = self._endpoints.get(key)
        if blocks is None:
            return 0
        matched = 0
        for chain_key in keys:
            if chain_key not in blocks.chains:
                break
            matched += 1
        return matched

    def match_tokens(self, key: str, token_ids: Sequence[int], block_size: int, *, lora: Optional[str] = None) -> int:
        """How many leading full blocks of ``token_ids`` the endpoint holds (under adapter ``lora``, if any)."""
        if key not in self._endpoints:
            return 0
        return self.match_keys(key, chain_keys(token_ids, block_size, lora))
