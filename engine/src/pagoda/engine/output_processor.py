"""From sequences with new tokens to caller-facing RequestOutputs: detokenize, find stop
strings, and assemble the ``n`` sequences of a request by its output kind."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import RequestOutputKind, resolve_bad_words

logger = logging.getLogger(__name__)

# What a client is told when its output could not be turned into text; the details go to the log.
DETOKENIZE_FAILED = "the request's output could not be detokenized"


@dataclass(slots=True)
class _SequenceState:
    request: Request
    detokenizer: IncrementalDetokenizer
    num_sent_tokens: int = 0
    num_detokenized: int = 0


@dataclass(slots=True)
class _RequestState:
    prompt: Optional[str]
    parent: Request
    sequences: dict[int, _SequenceState] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    """Owns the per-request detokenizers; one writer of output text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request: Request, prompt: Optional[str]) -> None:
        # bad_words become token sequences here, with the tokenizer, before the request is ever scheduled.
        resolve_bad_words(request.sampling_params, self.tokenizer)
        state = _RequestState(prompt=prompt, parent=request)
        state.sequences[0] = self._new_sequence(request)
        self.states[request.external_id] = state

    def remove_request(self, external_id: str) -> None:
        self.states.pop(external_id, None)

    def sequence_ids(self, external_id: str) -> list[str]:
        state = self.states.get(external_id)
        return [] if state is None else [s.request.request_id for s in state.sequences.values()]

    def detokenize(self, updated: list[Request]) -> tuple[list[Request], dict[str, str]]:
        """Feed new tokens to the detokenizers. Returns running sequences that hit a stop string
        (their ``stop_reason`` is set; the caller finishes them in the scheduler), and the requests
        whose detokenizer failed (external id -> message): the caller fails those alone."""
        stopped: list[Request] = []
        failed: dict[str, str] = {}
        for request in updated:
            if request.external_id in failed:
                continue
            try:
                stop = self._detokenize(request)
            except Exception:  # one request's text must never stop the engine
                logger.exception("request_id=%s: detokenizing its output failed", request.external_id)
                failed[request.external_id] = DETOKENIZE_FAILED
                continue
            if stop is None:
                continue
            request.stop_reason = stop
            if request.is_finished:  # finished by length or a stop token in this very step
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                stopped.append(request)
        return stopped, failed

    def _detokenize(self, request: Request) -> Optional[str]:
        seq = self._sequence(request)
        new_tokens = request.output_token_ids[seq.num_detokenized :]
        seq.num_detokenized = request.num_output_tokens
        # a sequence already finished as STOPPED here ended on EOS or a stop token id
        stop_terminated = request.status == RequestStatus.FINISHED_STOPPED
        return seq.detokenizer.update(new_tokens, stop_terminated=stop_terminated)

    def make_outputs(self, updated: list[Request]) -> tuple[list[RequestOutput], dict[str, str]]:
        """One RequestOutput per request touched this step (as its output kind allows), and the
        requests whose output could not be built (external id -> message), to be failed alone."""
        touched: dict[str, list[Request]] = {}
        for request in updated:
            touched.setdefault(request.external_id, []).append(request)
        outputs = []
        failed: dict[str, str] = {}
        for external_id, requests in touched.items():
            state = self.states.get(external_id)
            if state is None:
                continue
            try:
                output = self._make_output(state, requests)
            except Exception:
                logger.exception("request_id=%s: building its output failed", external_id)
                failed[external_id] = DETOKENIZE_FAILED
                continue
            if output is not None:
                outputs.append(output)
            if output is not None and output.finished:
                del self.states[external_id]
        return outputs, failed

    def fail_request(self, external_id: str, message: str, unavailable: bool = False) -> Optional[RequestOutput]:
        """The final output of a request that failed alone (``error`` set, every unfinished sequence
        "error"); forgets the request. None if it is not known (already finished or aborted)."""
        state = self.states.pop(external_id, None)
        if state is None:
            return None
        completions = []
        for seq in sorted(state.sequences.values(), key=lambda s: s.request.index):
            request = seq.request
            if not request.is_finished:
                request.status = RequestStatus.FINISHED_ERROR
            completions.append(
                CompletionOutput(index=request.index, text="", token_ids=[], finish_reason=request.status.finish_reason)
            )
        return RequestOutput(
            request_id=external_id,
            prompt=state.prompt,
            prompt_token_ids=state.parent.prompt_token_ids,
            outputs=completions,
            finished=True,
            metrics=self._metrics(state, True),
            num_cached_tokens=state.parent.num_cached_tokens or 0,
            error=message,
            error_unavailable=unavailable,
        )

    def _make_output(self, state: _RequestState, updated: list[Request]) -> Optional[RequestOutput]:
        params = state.parent.sampling_params
        finished = len(state.sequences) == params.n and all(s.request.is_finished for s in state.sequences.values())
        kind = params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        chosen = updated if delta else [s.request for s in state.sequences.values()]
        completions = [self._completion(state.sequences[r.index], delta) for r in sorted(chosen, key=lambda r: r.index)]
        prompt_logprobs = None
        parent = state.parent
        prompt_logprobs_ready = parent.prompt_logprobs is not None and not parent.pending_prompt_logprobs
        if prompt_logprobs_ready and not (delta and state.prompt_logprobs_sent):
            prompt_logprobs = self._with_decoded(parent.prompt_logprobs, state.sequences[0].detokenizer)
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.parent.external_id,
            prompt=state.prompt,
            prompt_token_ids=state.parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=self._metrics(state, finished),
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.parent.num_cached_tokens or 0,
            num_preemptions=sum(s.request.num_preemptions for s in state.sequences.values()),
        )

    def _completion(self, seq: _SequenceState, delta: bool) -> CompletionOutput:
        request = seq.request
        finished = request.is_finished
        start = seq.num_sent_tokens if delta else 0
        text = seq.detokenizer.get_next_output_text(finished, delta)
        token_ids = request.output_token_ids[start:]
        logprobs = None
        if request.logprobs is not None:
            logprobs = self._with_decoded(request.logprobs[start:], seq.detokenizer)
        seq.num_sent_tokens = request.num_output_tokens
        return CompletionOutput(
            index=request.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )

    @staticmethod
    def _with_decoded(entries: list[Optional[PositionLogprobs]], detokenizer: IncrementalDetokenizer):
        for entry in entries:
            for token_id, logprob in (entry or {}).items():
                if logprob.decoded_token is None:
                    logprob.decoded_token = detokenizer.decode_token(token_id)
        return list(entries)

    @staticmethod
    def _metrics(state: _RequestState, finished: bool) -> RequestMetrics:
        requests = [s.request for s in state.sequences.values()]
        first_token = [r.first_token_time for r in requests if r.first_token_time is not None]
        last_token = [r.last_token_time for r in requests if r.last_token_time is not None]
        return RequestMetrics(
            arrival_time=state.parent.arrival_time,
            first_scheduled_time=state.parent.first_scheduled_time,
            first_token_time=min(first_token, default=None),
            last_token_time=max(last_token, default=None),
            finished_time=time.monotonic() if finished else None,
        )

    def _sequence(self, request: Request) -> _SequenceState:
        state = self.states[request.external_id]
        seq = state.sequences.get(request.index)
        if seq is None:  # a forked sibling seen for the first time
            seq = state.sequences[request.index] = self._new_sequence(request)
        return seq

    def _new_sequence(self, request: Request) -> _SequenceState:
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params)
        return _SequenceState(request=request, detokenizer=detokenizer)
