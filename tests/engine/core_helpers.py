"""Builders for scheduler/KV-manager tests: requests without a model or tokenizer."""

from __future__ import annotations

import itertools
import time
from typing import Optional

from pagoda.core.scheduler import Scheduler
from pagoda.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

_seq = itertools.count()

EOS = 2


def make_request(
    prompt: list[int],
    max_tokens: int = 8,
    request_id: Optional[str] = None,
    lora_id: Optional[int] = None,
    cache_salt: Optional[str] = None,
    **params,
) -> Request:
    seq = next(_seq)
    return Request(
        request_id=request_id or f"r{seq}",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, **params}),
        arrival_time=time.monotonic(),
        arrival_seq=seq,
        eos_token_ids=frozenset({EOS}),
        max_tokens=max_tokens,
        lora_id=lora_id,
        cache_salt=cache_salt,
    )


def fake_execute(plan: SchedulerOutput, next_token=lambda request: 7) -> ModelRunnerOutput:
    """What a model runner reports: one token for each sequence that reaches its end
    (``n`` tokens for a sequence about to fork)."""
    out = ModelRunnerOutput()
    for item in plan.scheduled:
        if item.samples:
            r = item.request
            count = r.sampling_params.n if r.needs_fork else 1
            out.sampled_token_ids[r.request_id] = [next_token(r) for _ in range(count)]
    return out


def check_invariants(scheduler: Scheduler) -> None:
    """Ref count of every block == number of live sequences whose table holds it."""
    kv = scheduler.kv
    holders: dict[int, int] = {}
    for blocks in kv.req_blocks.values():
        for block in blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
    assert kv.pool.num_free_blocks == sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)
    for request in scheduler.running:
        assert request.num_computed_tokens <= request.num_tokens
    assert set(kv.req_blocks) <= {r.request_id for r in scheduler.running}
    # the waiting-sequence counter that admission control reads from other threads
    assert scheduler.num_waiting_seqs == sum(r.sampling_params.n if r.needs_fork else 1 for r in scheduler.waiting)
