"""Which KV blocks each sequence holds: prefix-cache lookup, slot allocation, fork and free."""

from __future__ import annotations

from typing import Optional

from pagoda.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from pagoda.core.kv_events import KVEventCollector
from pagoda.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps sequences to block lists and asks the pool for blocks.

    Callers get opaque block lists (and block ids for the model runner); they never touch ref
    counts. ``allocate_slots`` returning ``None`` means "no room: preempt someone".
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, events: Optional[KVEventCollector] = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.pool.events = events  # None: no KV events (nothing is logged)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a sequence already hashed in the pool
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request.request_id, ())]

    def num_blocks_held(self, request: Request) -> int:
        return len(self.req_blocks.get(request.request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached run of the sequence's full blocks, and how many tokens it covers.

        At least the last token is always left to compute (its logits are needed), and requests
        that want prompt logprobs compute their whole prompt.
        """
        if not self.enable_caching or request.pending_prompt_logprobs:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_cache_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Optional[list[KVBlock]] = None
    ) -> Optional[list[KVBlock]]:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (plus cache hits).

        Returns the sequence's whole block list, or ``None`` (and changes nothing) when the pool
        cannot supply enough blocks.
        """
        hits = new_computed_blocks or []
        blocks = self.req_blocks.get(request.request_id, [])
        num_tokens_after = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        assert num_tokens_after <= request.num_tokens, "cannot compute tokens that do not exist"
        num_needed = cdiv(num_tokens_after, self.block_size) - len(blocks) - len(hits)
        # A hit on a free (cached-but-evictable) block takes it out of the free pool too.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if max(num_needed, 0) + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(hits)
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        blocks.extend(hits)
        if num_needed > 0:
            blocks.extend(self.pool.allocate(num_needed))
        # The KV of these tokens is written in this step before anyone can read it, so their
        # full blocks may be offered to other sequences right away.
        self._cache_full_blocks(request, num_tokens_after)
        return blocks

    def fork(self, parent: Request, child: Request) -> Optional[list[tuple[int, int]]]:
        """Give ``child`` the parent's computed blocks: full ones shared, the partial tail copied.

        Returns the ``(src_block_id, dst_block_id)`` copies the model runner must make before
        the child's next forward (empty when the prompt ends on a block boundary), or ``None``
        (and changes nothing) when no block is free for the copy.
        """
        parent_blocks = self.req_blocks[parent.request_id]
        num_full = parent.num_computed_tokens // self.block_size
        has_tail = parent.num_computed_tokens % self.block_size != 0
        if has_tail and self.pool.num_free_blocks < 1:
            return None
        shared = parent_blocks[:num_full]
        self.pool.touch(shared)
        child_blocks = list(shared)
        copies: list[tuple[int, int]] = []
        if has_tail:
            (tail,) = self.pool.allocate(1)
            copies.append((parent_blocks[num_full].block_id, tail.block_id))
            child_blocks.append(tail)
        self.req_blocks[child.request_id] = child_blocks
        self.num_cached_blocks[child.request_id] = min(self.num_cached_blocks.get(parent.request_id, 0), num_full)
        child.block_hashes = list(parent.block_hashes[:num_full])
        return copies

    def free(self, request: Request) -> None:
        """Release every block of the sequence (tail first, so tails are evicted first).

        Blocks past ``num_computed_tokens`` were published to the prefix cache when they were
        allocated, on the promise that this step's forward fills them; a sequence freed before
        that forward (preempted while the step is being planned) takes the promise back.
        """
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if not blocks:
            return
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.pool.uncache(block)
        self.pool.free(reversed(blocks))

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        extra = _extra_keys(request)
        bs = self.block_size
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i > 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self.req_blocks[request.request_id]
        hashes = request.block_hashes
        if self.pool.events is None:
            for i in range(start, num_full):
                self.pool.cache_full_block(blocks[i], hashes[i])
        else:
            self._cache_and_log(request, start, num_full)
        self.num_cached_blocks[request.request_id] = num_full

    def _cache_and_log(self, request: Request, start: int, stop: int) -> None:
        """Cache blocks ``start:stop`` and log one BlockStored per run of them that entered the cache (a block
        whose hash another block already holds is not stored again, and splits the run)."""
        blocks, hashes, bs = self.req_blocks[request.request_id], request.block_hashes, self.block_size
        run_start = None
        for i in range(start, stop + 1):
            if i < stop and self.pool.cache_full_block(blocks[i], hashes[i]):
                run_start = i if run_start is None else run_start
                continue
            if run_start is not None:
                parent = hashes[run_start - 1] if run_start > 0 else None
                tokens = request.all_token_ids[run_start * bs : i * bs]
                self.pool.events.stored(hashes[run_start:i], parent, tokens, request.lora_id)
                run_start = None


def _extra_keys(request: Request) -> tuple:
    if request.lora_id is None and request.cache_salt is None:
        return ()
    return (request.lora_id, request.cache_salt)
