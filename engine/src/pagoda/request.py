"""The state of one sequence inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagoda.outputs import PositionLogprobs
from pagoda.sampling_params import SamplingParams


def sequence_id(external_id: str, index: int) -> str:
    """Engine-internal id of sequence ``index`` of a request. Splitting at the last ``#`` gives
    back ``(external_id, index)``, so no two (request, index) pairs can share an id."""
    return f"{external_id}#{index}"


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status >= FINISHED_STOPPED`` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # this request alone failed (no valid token, a tokenizer or detokenizer error)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence: its tokens, how far the KV cache has computed them, and its status.

    A request with ``n > 1`` is one sequence until its prompt is computed; the scheduler then
    forks it into ``n`` sequences (``index`` 0..n-1) that share the prompt's blocks.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    arrival_seq: int  # total order of arrival, for FCFS and the preemption victim
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved: never None, prompt + max_tokens <= max_model_len
    generator: Optional[torch.Generator] = None
    sibling_generators: Optional[list[Optional[torch.Generator]]] = None  # for sequences 1..n-1
    lora_id: Optional[int] = None
    cache_salt: Optional[str] = None
    priority: int = 0  # --scheduling-policy priority: lower runs first (ties by arrival); fcfs: always 0
    index: int = 0  # which of the parent's n sequences this is
    parent_id: Optional[str] = None  # the caller's request id (shared by the n sequences of a request)
    forked: bool = False  # True once an n > 1 request has been split into its sequences
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: Optional[int] = None  # prefix-cache hit at first scheduling
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks
    stop_reason: Optional[int | str] = None
    cumulative_logprob: float = 0.0
    logprobs: Optional[list[PositionLogprobs]] = None
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    pending_prompt_logprobs: bool = False  # still to be computed (first pass over the prompt)
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    # Token counts for the penalties (a worker-side cache of output_token_ids, on the logits' device), kept
    # from the first sampled token on; never shared between sequences (a fork starts its own).
    penalty_counts: Optional[object] = None
    # Structured output: this sequence's grammar state (a RequestGrammar); None when unconstrained. The scheduler
    # leaves the request waiting until it is ready; every sequence of an n > 1 request has its own.
    grammar: Optional[Any] = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.sampling_params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob
            self.pending_prompt_logprobs = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def external_id(self) -> str:
        """The id the caller knows this sequence by."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def grammar_pending(self) -> bool:
        """Its structured-output grammar is still compiling: it cannot be scheduled yet."""
        return self.grammar is not None and not self.grammar.ready

    @property
    def needs_fork(self) -> bool:
        """True while this is the single prompt sequence of an ``n > 1`` request."""
        return self.sampling_params.n > 1 and not self.forked

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
