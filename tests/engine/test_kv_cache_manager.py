"""KV-cache manager: cached-prefix lookup, slot allocation, fork and free."""

from core_helpers import make_request

from pagoda.core.kv_cache_manager import KVCacheManager

BS = 4


def _admit(kv: KVCacheManager, request, num_new=None):
    hits, num_cached = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_cached if num_new is None else num_new
    blocks = kv.allocate_slots(request, num_new, hits)
    assert blocks is not None
    request.num_computed_tokens = num_cached + num_new
    return num_cached


def test_allocates_ceil_of_tokens_over_block_size():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    request = make_request(list(range(10, 19)))  # 9 tokens -> 3 blocks
    _admit(kv, request)
    assert len(kv.get_block_ids(request)) == 3
    request.append_output_token(5)  # token 10 fits in the third block
    assert kv.allocate_slots(request, 1) is not None and kv.num_blocks_held(request) == 3
    request.num_computed_tokens += 1
    for _ in range(3):
        request.append_output_token(5)
    assert kv.allocate_slots(request, 3) is not None and kv.num_blocks_held(request) == 4


def test_cached_prefix_is_full_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    first = make_request(list(range(100, 108)))  # exactly 2 full blocks
    _admit(kv, first)
    same = make_request(list(range(100, 108)))
    hits, num_cached = kv.get_computed_blocks(same)
    assert num_cached == 4  # the last token must be computed, so only the first block hits
    longer = make_request(list(range(100, 111)))
    hits, num_cached = kv.get_computed_blocks(longer)
    assert num_cached == 8 and [b.block_id for b in hits] == kv.get_block_ids(first)[:2]


def test_hits_survive_the_owner_finishing_and_count_ref_and_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    first = make_request(list(range(1, 10)))
    _admit(kv, first)
    kv.free(first)
    assert kv.num_free_blocks == 4
    again = make_request(list(range(1, 10)))
    assert _admit(kv, again) == 8
    assert kv.num_free_blocks == 1
    kv.record_prefix_cache_query(again.num_tokens, 8)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 8)


def test_different_lora_or_salt_never_hits():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(30, 42))
    _admit(kv, make_request(prompt))
    assert kv.get_computed_blocks(make_request(prompt, lora_id=1))[1] == 0
    assert kv.get_computed_blocks(make_request(prompt, cache_salt="tenant-a"))[1] == 0
    _admit(kv, make_request(prompt, cache_salt="tenant-a"))
    assert kv.get_computed_blocks(make_request(prompt, cache_salt="tenant-a"))[1] == 8
    assert kv.get_computed_blocks(make_request(prompt, cache_salt="tenant-b"))[1] == 0


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False)
    prompt = list(range(50, 62))
    _admit(kv, make_request(prompt))
    assert kv.get_computed_blocks(make_request(prompt)) == ([], 0)


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(50, 62))
    _admit(kv, make_request(prompt))
    assert kv.get_computed_blocks(make_request(prompt, prompt_logprobs=1)) == ([], 0)


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    holder = make_request(list(range(8)))
    _admit(kv, holder)
    big = make_request(list(range(100, 110)))
    assert kv.allocate_slots(big, 10) is None
    assert kv.num_free_blocks == 1 and kv.get_block_ids(big) == []


def test_free_cached_hits_count_against_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    owner = make_request(list(range(1, 9)))  # 2 blocks, both cached after free
    _admit(kv, owner)
    kv.free(owner)
    request = make_request(list(range(1, 9)) + list(range(20, 28)))  # needs 4 blocks in all
    hits, _ = kv.get_computed_blocks(request)
    assert len(hits) == 2
    assert kv.allocate_slots(request, 8, hits) is None  # 2 hits (free) + 2 new > 3 free
    assert all(b.ref_cnt == 0 for b in hits)


def test_fork_shares_full_blocks_and_copies_the_partial_tail():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    parent = make_request(list(range(1, 11)))  # 10 tokens: 2 full blocks + a tail of 2
    _admit(kv, parent)
    child = make_request(list(range(1, 11)))
    child.num_computed_tokens = parent.num_computed_tokens
    copies = kv.fork(parent, child)
    parent_ids, child_ids = kv.get_block_ids(parent), kv.get_block_ids(child)
    assert child_ids[:2] == parent_ids[:2]
    assert child_ids[2] != parent_ids[2]
    assert copies == [(parent_ids[2], child_ids[2])]
    assert [kv.pool.blocks[i].ref_cnt for i in parent_ids] == [2, 2, 1]
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 10


def test_fork_on_a_block_boundary_copies_nothing_and_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    parent = make_request(list(range(1, 9)))
    _admit(kv, parent)
    child = make_request(list(range(1, 9)))
    child.num_computed_tokens = 8
    assert kv.fork(parent, child) == []
    tail_parent = make_request(list(range(40, 42)))
    _admit(kv, tail_parent)  # takes the last free block
    tail_child = make_request(list(range(40, 42)))
    tail_child.num_computed_tokens = 2
    assert kv.fork(tail_parent, tail_child) is None
    assert kv.get_block_ids(tail_child) == []


def test_blocks_published_for_a_step_that_never_ran_are_withdrawn_on_free():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    request = make_request(list(range(1, 8)))  # 7 tokens
    _admit(kv, request)
    request.append_output_token(9)  # the 8th token completes the second block
    assert kv.allocate_slots(request, 1) is not None
    second = kv.req_blocks[request.request_id][1]
    assert second.block_hash is not None  # published, on the promise that this step writes it
    kv.free(request)  # preempted before the forward ran: num_computed_tokens is still 7
    assert second.block_hash is None
    again = make_request(list(range(1, 8)) + [9, 10])
    assert kv.get_computed_blocks(again)[1] == 4  # only the block whose KV was really written
