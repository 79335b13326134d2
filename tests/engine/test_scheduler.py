"""Scheduler: token budget, FCFS, chunked prefill, preemption, fork, and no leaked blocks."""

import random

from core_helpers import EOS, check_invariants, fake_execute, make_request

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.request import RequestStatus


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=128, chunked=True):
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, chunked)
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def run_step(scheduler, next_token=lambda r: 7):
    plan = scheduler.schedule()
    updated = scheduler.update_from_output(plan, fake_execute(plan, next_token))
    check_invariants(scheduler)
    return plan, updated


def test_decodes_keep_flowing_while_a_long_prompt_is_chunked():
    scheduler = make_scheduler(budget=16)
    short = make_request(list(range(10, 14)), max_tokens=20)
    scheduler.add_request(short)
    run_step(scheduler)  # short's prompt, first token sampled
    long = make_request(list(range(100, 150)), max_tokens=4)  # 50 tokens > budget
    scheduler.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        plan, _ = run_step(scheduler)
        tokens = {s.request.request_id: s.num_tokens for s in plan.scheduled}
        assert tokens[short.request_id] == 1  # the decode is never starved
        assert sum(tokens.values()) <= 16
        chunks.append(tokens[long.request_id])
    assert chunks == [15, 15, 15, 5]
    assert scheduler.num_chunked_prefill_steps == 3


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    scheduler = make_scheduler(budget=16, chunked=False, max_model_len=16)
    a = make_request(list(range(10, 20)), max_tokens=2)
    b = make_request(list(range(30, 40)), max_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    plan, _ = run_step(scheduler)
    assert [s.request for s in plan.scheduled] == [a]  # b does not fit in the rest of the budget
    plan, _ = run_step(scheduler)
    assert {s.request.request_id: s.num_tokens for s in plan.scheduled} == {a.request_id: 1, b.request_id: 10}


def test_waiting_requests_are_admitted_first_come_first_served_up_to_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2, budget=100)
    requests = [make_request([5, 6, 7], max_tokens=3) for _ in range(4)]
    for r in requests:
        scheduler.add_request(r)
    plan, _ = run_step(scheduler)
    assert [s.request for s in plan.scheduled] == requests[:2]
    assert list(scheduler.waiting) == requests[2:]


def test_preemption_evicts_the_latest_arrival_and_requeues_it_first():
    # 4 blocks of 4 hold one max-length (16-token) sequence, as start-up guarantees
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64, max_model_len=16)
    old = make_request(list(range(1, 9)), max_tokens=8)  # 8 tokens: 2 full blocks
    new = make_request(list(range(20, 28)), max_tokens=8)  # 2 full blocks
    later = make_request([40, 41], max_tokens=2)
    for r in (old, new, later):
        scheduler.add_request(r)
    run_step(scheduler)
    assert scheduler.running == [old, new]
    plan, _ = run_step(scheduler)  # both now need a third block: only one can have it
    assert plan.preempted_ids == [new.request_id]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert list(scheduler.waiting) == [new, later]  # back at the front, ahead of later arrivals
    assert scheduler.num_preemptions_total == 1
    while old.status == RequestStatus.RUNNING:
        run_step(scheduler)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert old.num_output_tokens == new.num_output_tokens == 8  # new was recomputed and finished


def test_length_eos_and_stop_token_ids_finish_and_free():
    scheduler = make_scheduler()
    by_length = make_request([3, 4, 5], max_tokens=2)
    by_eos = make_request([3, 4, 6], max_tokens=10)
    by_stop_id = make_request([3, 4, 7], max_tokens=10, stop_token_ids=[99])
    ignoring = make_request([3, 4, 8], max_tokens=3, ignore_eos=True)
    for r in (by_length, by_eos, by_stop_id, ignoring):
        scheduler.add_request(r)
    tokens = {by_eos.request_id: EOS, by_stop_id.request_id: 99, ignoring.request_id: EOS}
    while scheduler.has_unfinished_requests():
        run_step(scheduler, lambda r: tokens.get(r.request_id, 7))
    assert by_length.status == RequestStatus.FINISHED_LENGTH and by_length.output_token_ids == [7, 7]
    assert by_eos.status == RequestStatus.FINISHED_STOPPED and by_eos.stop_reason is None
    assert by_stop_id.status == RequestStatus.FINISHED_STOPPED and by_stop_id.stop_reason == 99
    assert ignoring.status == RequestStatus.FINISHED_LENGTH and ignoring.output_token_ids == [EOS] * 3
    assert scheduler.kv.num_free_blocks == 64


def test_n_sequences_share_the_prompt_blocks_after_one_prefill():
    scheduler = make_scheduler(block_size=4)
    request = make_request(list(range(1, 11)), max_tokens=3, n=3, temperature=1.0, seed=0)
    scheduler.add_request(request)
    plan, updated = run_step(scheduler)
    assert len(plan.scheduled) == 1  # the prompt is computed once
    assert [r.index for r in updated] == [0, 1, 2]
    assert {r.external_id for r in updated} == {request.request_id}
    tables = [scheduler.kv.get_block_ids(r) for r in updated]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # full prompt blocks shared
    assert len({t[2] for t in tables}) == 3  # the partial tail copied per sequence
    assert len(scheduler.pending_block_copies) == 2
    plan, _ = run_step(scheduler)
    assert plan.block_copies and len(plan.scheduled) == 3
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert all(r.num_output_tokens == 3 for r in updated)
    assert scheduler.kv.num_free_blocks == 64


def test_abort_frees_blocks_wherever_the_request_is():
    scheduler = make_scheduler(max_num_seqs=1)
    running = make_request([1, 2, 3], max_tokens=10)
    waiting = make_request([4, 5, 6], max_tokens=10)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)
    finished = scheduler.finish_requests([running.request_id, waiting.request_id], RequestStatus.FINISHED_ABORTED)
    assert finished == [running, waiting]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == 64
    assert scheduler.finish_requests(["unknown"], RequestStatus.FINISHED_ABORTED) == []


def test_thousand_random_requests_with_aborts_leave_every_block_free():
    rng = random.Random(1234)
    scheduler = make_scheduler(num_blocks=48, block_size=4, max_num_seqs=16, budget=48, max_model_len=64)
    shared_prefix = [rng.randrange(3, 500) for _ in range(12)]
    added = 0
    steps = 0
    while added < 1000 or scheduler.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if added < 1000:
                prefix = shared_prefix if rng.random() < 0.5 else []
                prompt = prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
                n = 2 if rng.random() < 0.1 else 1
                scheduler.add_request(make_request(prompt, max_tokens=rng.randrange(1, 20), n=n, temperature=1.0))
                added += 1
        if scheduler.requests and rng.random() < 0.2:
            victim = rng.choice(list(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        run_step(scheduler, lambda r: EOS if rng.random() < 0.05 else rng.randrange(3, 500))
        steps += 1
        assert steps < 20000
    assert scheduler.kv.num_free_blocks == 48
    assert all(b.ref_cnt == 0 for b in scheduler.kv.pool.blocks)
    assert not scheduler.kv.req_blocks
    assert scheduler.num_preemptions_total > 0  # the pool is small enough to force some
    assert scheduler.kv.prefix_cache_hits > 0
