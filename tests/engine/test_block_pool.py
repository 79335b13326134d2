"""Block pool: ref counts, the LRU free queue, the hash chain and eviction."""

import pytest

from pagoda.core.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens


def test_all_blocks_start_free_and_unreferenced():
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8
    assert pool.usage == 0.0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


def test_allocate_takes_least_recently_freed_first():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    pool.free([c, a])  # c freed before a
    pool.free([d])
    assert [blk.block_id for blk in pool.allocate(3)] == [c.block_id, a.block_id, d.block_id]


def test_free_queue_removes_from_the_middle_in_constant_time():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [1, 3]
    assert queue.num_free_blocks == 2
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 0]
    assert queue.popleft() is blocks[1]


def test_ref_counts_follow_touch_and_free():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    assert block.ref_cnt == 1
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])


def test_freed_full_block_stays_cached_until_reused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_block(block, h)
    pool.free([block])
    assert pool.get_cached_block(h) is block  # cached-but-evictable
    pool.touch([block])  # a hit takes it back out of the free queue
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([block])
    pool.allocate(2)  # reuse evicts its hash
    assert pool.get_cached_block(h) is None
    assert block.block_hash is None
    assert pool.num_evictions == 1


def test_eviction_is_lru_and_never_touches_referenced_blocks():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = [hash_block_tokens(None, [i]) for i in range(4)]
    for block, h in zip(blocks, hashes):
        pool.cache_full_block(block, h)
    pool.free([blocks[3], blocks[1], blocks[0]])  # blocks[2] stays referenced
    (first,) = pool.allocate(1)
    assert first is blocks[3]  # least recently freed goes first
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    pool.allocate(2)
    assert pool.get_cached_block(hashes[2]) is blocks[2]  # the referenced block is never evicted
    assert all(pool.get_cached_block(hashes[i]) is None for i in (0, 1, 3))


def test_disabled_caching_never_records_hashes():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.cache_full_block(block, hash_block_tokens(None, [1]))
    assert block.block_hash is None and not pool.cached


def test_hash_chain_commits_to_parent_tokens_and_extra_keys():
    tokens = [5, 6, 7, 8]
    root = hash_block_tokens(None, tokens)
    assert root == hash_block_tokens(None, list(tokens))
    assert root != hash_block_tokens(None, [5, 6, 7, 9])
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(root, tokens) != hash_block_tokens(other_parent, tokens)
    assert hash_block_tokens(None, tokens, (1, None)) != root  # LoRA id
    assert hash_block_tokens(None, tokens, (None, "salt")) != root  # cache salt
    assert hash_block_tokens(None, tokens, (1, None)) != hash_block_tokens(None, tokens, (2, None))


def test_reset_prefix_cache_only_when_nothing_is_referenced():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_full_block(block, hash_block_tokens(None, [1]))
    assert not pool.reset_prefix_cache()
    pool.free([block])
    assert pool.reset_prefix_cache()
    assert not pool.cached


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)
