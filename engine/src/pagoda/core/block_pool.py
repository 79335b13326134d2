"""The pool of KV blocks: ref counts, the LRU free queue and the prefix-cache hash map.

The pool is the only owner of ref counts. A block whose last user frees it keeps its hash
and stays findable (cached-but-evictable) until it is handed out again; blocks are handed
out from the head of the free queue (least recently freed), so eviction is LRU and can never
touch a block that is referenced (referenced blocks are not in the queue).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from pagoda.core.kv_events import KVEventCollector

BlockHash = bytes


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of ``block_size`` KV slots; a node of the free queue while unreferenced."""

    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None
    prev_free: Optional[KVBlock] = None
    next_free: Optional[KVBlock] = None


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Chain hash of a full block: it commits to every token before it and to the extra keys
    (LoRA id, cache salt), so equal hashes mean equal KV contents."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"\0" * 16)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append, and removal from the
    middle (when a cached free block is hit and taken back into use)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head: Optional[KVBlock] = None
        self._tail: Optional[KVBlock] = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None and block is not self._head
        block.prev_free = self._tail
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self.num_free_blocks += 1

    def popleft(self) -> KVBlock:
        block = self._head
        assert block is not None, "no free block"
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None:
            assert self._head is block, "block is not in the free queue"
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head
        while block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """All KV blocks of the engine, created once at start."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.events: Optional[KVEventCollector] = None  # set when KV events are published (see kv_events)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, whether or not they hold cached KV)."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVBlock]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` from the free queue's LRU end, evicting their cached hashes."""
        assert num_blocks <= self.num_free_blocks, "caller must check capacity first"
        taken = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; unreferenced blocks join the free queue's MRU end.

        Callers pass a request's blocks tail first, so that the tail of a sequence (least
        likely to be shared) is evicted before its head.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Record that ``block`` holds the KV of the full block named by ``block_hash``; whether that made the
        hash findable (False: caching is off, the block has its hash already, or an identical block is cached)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; keep the first one findable
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache(self, block: KVBlock) -> None:
        """Withdraw a block's hash (its KV was never written, e.g. its owner was preempted
        before the forward that would have filled it)."""
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self.num_evictions += 1
            if self.events is not None:
                self.events.removed(block.block_hash)
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; only possible while no block is referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
