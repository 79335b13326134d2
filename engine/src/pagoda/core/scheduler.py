"""Continuous batching: who runs this step, and how many tokens each gets.

There are no prefill or decode phases: each running sequence's ``num_computed_tokens``
catches up with its ``num_tokens`` under one token budget. Running sequences go first (a
decode is a one-token chunk, a long prompt is chunked), then waiting ones in the order of the
scheduling policy (see :mod:`pagoda.core.request_queue`: arrival order, or priority then arrival).
When blocks run out, the request the policy would run last is preempted (its blocks freed,
recomputed later) and queued again (fcfs: at the front).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Optional

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request_queue import RequestQueue, create_request_queue, preemption_victim
from pagoda.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagoda.request import Request, RequestStatus, sequence_id


class Scheduler:
    """Plans steps and applies their results to request state. Holds no tensors."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        adapter_ready: Optional[Callable[[int], bool]] = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        # Whether a step can have a LoRA adapter's weights now; a request whose adapter is not ready waits (the
        # engine reads it meanwhile, off this thread). None: always ready.
        self.adapter_ready = adapter_ready
        self.waiting: RequestQueue = create_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.pending_block_copies: list[tuple[int, int]] = []
        self.num_preemptions_total = 0
        self.num_chunked_prefill_steps = 0  # steps that computed part, not all, of some prompt
        # Sequences the waiting queue stands for (an unforked n > 1 request counts n). Kept as a counter
        # because other threads read it (admission control) while this one changes the queue.
        self.num_waiting_seqs = 0
        # Sequences that failed while their results were applied (sequence id -> message), for the engine to
        # report; see pop_request_errors.
        self.request_errors: dict[str, str] = {}

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self._enqueue(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) sequences wherever they are; frees their blocks."""
        assert status.finished
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self._dequeue(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission, preempted ones included."""
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def pop_request_errors(self) -> dict[str, str]:
        """The sequences that failed in the last ``update_from_output`` (already finished), with why."""
        errors, self.request_errors = self.request_errors, {}
        return errors

    # ---- planning ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch under ``max_num_batched_tokens`` and ``max_num_seqs``."""
        out = SchedulerOutput(block_copies=self.pending_block_copies)
        self.pending_block_copies = []
        scheduled: dict[str, ScheduledRequest] = {}
        budget = self.config.max_num_batched_tokens
        # Decodes go before prefill chunks so a long prompt never starves them of the budget.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        chunks = [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        for request in decodes + chunks:
            if request.status != RequestStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or the budget is spent
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = preemption_victim(self.running, self.config.scheduling_policy)
                budget += self._preempt(victim, scheduled)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            scheduled[request.request_id] = ScheduledRequest(request, num_new, self.kv.get_block_ids(request))
            budget -= num_new
        if not out.preempted_ids:  # admitting while evicting would only thrash
            budget = self._admit_waiting(scheduled, budget)
        out.scheduled = list(scheduled.values())
        if any(s.request.num_computed_tokens + s.num_tokens < s.request.num_prompt_tokens for s in out.scheduled):
            self.num_chunked_prefill_steps += 1
        return out

    def _admit_waiting(self, scheduled: dict[str, ScheduledRequest], budget: int) -> int:
        now = time.monotonic()
        # Set aside (and put back in order below): requests whose grammar compiles, and requests whose adapter
        # has no slot this step or is being read. The requests behind them go first.
        deferred: list[Request] = []
        adapters = _AdapterSlots(self.config.max_loras, self.running)
        while self.waiting and budget > 0:
            request = self.waiting.peek()
            if request.grammar_pending or not adapters.admits(request.lora_id) or not self._adapter_ready(request):
                deferred.append(self.waiting.pop())
                continue
            seats = _seats(request)
            if self.running and len(self.running) + seats > self.config.max_num_seqs:
                break
            hits, num_cached = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, hits) is None:
                break
            self._dequeue(request)
            if self.kv.enable_caching and not request.pending_prompt_logprobs:
                self.kv.record_prefix_cache_query(request.num_tokens, num_cached)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            adapters.add(request.lora_id)
            scheduled[request.request_id] = ScheduledRequest(request, num_new, self.kv.get_block_ids(request))
            budget -= num_new
        self.waiting.restore(deferred)  # still counted in num_waiting_seqs: never dequeued
        return budget

    def _adapter_ready(self, request: Request) -> bool:
        return request.lora_id is None or self.adapter_ready is None or self.adapter_ready(request.lora_id)

    def _preempt(self, request: Request, scheduled: dict[str, ScheduledRequest]) -> int:
        """Free the sequence's blocks and queue it first for recompute; returns budget given back."""
        undone = scheduled.pop(request.request_id, None)
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if request.pending_prompt_logprobs:  # recomputed from the start, so collected again
            request.prompt_logprobs = [None]
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue(request, front=True)
        return undone.num_tokens if undone is not None else 0

    # ---- applying results ----------------------------------------------------------------

    def update_from_output(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, fork ``n > 1`` requests, and finish
        sequences on EOS, stop token ids or length. Returns every sequence that got new tokens
        or finished (forked children included)."""
        now = time.monotonic()
        updated: list[Request] = []
        for item in plan.scheduled:
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # finished or preempted after planning
            request.num_computed_tokens += item.num_tokens
            if request.pending_prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs.get(request.request_id, ()))
                if request.num_computed_tokens >= request.num_prompt_tokens:
                    request.pending_prompt_logprobs = False
            tokens = result.sampled_token_ids.get(request.request_id)
            if tokens is None:
                continue
            logprobs = result.logprobs.get(request.request_id)
            sequences = self._fork(request) if request.needs_fork else [request]
            assert len(sequences) == len(tokens)
            for i, (seq, token) in enumerate(zip(sequences, tokens)):
                self._append_token(seq, token, logprobs[i] if logprobs else None, now)
                updated.append(seq)
        return updated

    def _append_token(self, request: Request, token: int, logprobs, now: float) -> None:
        request.append_output_token(token)
        refused = request.grammar is not None and not request.grammar.accept(token)
        if refused:  # only possible if the mask was not applied: fail this request alone, never emit invalid output
            self.request_errors[request.request_id] = f"token {token} was sampled against the output's grammar"
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        if logprobs is not None and request.logprobs is not None:
            request.logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token].logprob
        status = RequestStatus.FINISHED_ERROR if refused else self._stop_status(request, token)
        if status is not None and request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._finish(request, status)
        elif status is not None:  # a fork child that is waiting for recompute
            self._dequeue(request)
            self._finish(request, status)

    def _stop_status(self, request: Request, token: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        if request.grammar is not None and request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the output is complete (even with ignore_eos)
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.all_stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fork(self, parent: Request) -> list[Request]:
        """Split an ``n > 1`` request whose prompt is computed into n sequences sharing its blocks."""
        parent.forked = True
        children = []
        position = self.running.index(parent) + 1
        for index in range(1, parent.sampling_params.n):
            child = replace(
                parent,
                request_id=sequence_id(parent.external_id, index),
                parent_id=parent.external_id,
                index=index,
                generator=parent.sibling_generators[index - 1] if parent.sibling_generators else None,
                sibling_generators=None,
                output_token_ids=[],
                all_token_ids=list(parent.all_token_ids),
                block_hashes=[],
                logprobs=[] if parent.logprobs is not None else None,
                prompt_logprobs=None,
                pending_prompt_logprobs=False,
                penalty_counts=None,
                grammar=parent.grammar.fork() if parent.grammar is not None else None,
            )
            child.pending_prompt_logprobs = False  # replace() re-ran __post_init__; the parent collects them
            self.requests[child.request_id] = child
            copies = self.kv.fork(parent, child)
            if copies is None:  # no block for its tail copy: recompute it later instead
                child.status = RequestStatus.PREEMPTED
                child.num_computed_tokens = 0
                self._enqueue(child, front=True)
            else:
                self.pending_block_copies.extend(copies)
                self.running.insert(position, child)
                position += 1
            children.append(child)
        parent.sibling_generators = None
        return [parent, *children]

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if front:
            self.waiting.prepend(request)
        else:
            self.waiting.add(request)
        self.num_waiting_seqs += _seats(request)

    def _dequeue(self, request: Request) -> None:
        self.waiting.remove(request)
        self.num_waiting_seqs -= _seats(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]


class _AdapterSlots:
    """Admission's view of LoRA slots: the running sequences never use more than ``max_loras`` adapters.

    A request whose adapter is running is admitted as usual; one with a new adapter needs a free slot. Once a
    request waits for a slot, one running adapter (the one with the fewest running sequences) stops taking new
    requests, so it drains and frees its slot: a waiting adapter is never starved by busy ones. ``max_loras``
    0 (LoRA off) admits everything.
    """

    def __init__(self, max_loras: int, running: list[Request]) -> None:
        self.max_loras = max_loras
        self.counts: dict[int, int] = {}
        for request in running:
            self.add(request.lora_id)
        self.draining: Optional[int] = None

    def add(self, lora_id: Optional[int]) -> None:
        if lora_id is not None:
            self.counts[lora_id] = self.counts.get(lora_id, 0) + 1

    def admits(self, lora_id: Optional[int]) -> bool:
        if lora_id is None or self.max_loras == 0:
            return True
        if lora_id in self.counts:
            return lora_id != self.draining
        if len(self.counts) < self.max_loras:
            return True
        if self.draining is None:  # the first request this step that waits for a slot
            self.draining = min(self.counts, key=lambda i: (self.counts[i], i))
        return False


def _seats(request: Request) -> int:
    """Sequences a request stands for: n until an n > 1 request is forked, then 1 each."""
    return request.sampling_params.n if request.needs_fork else 1
