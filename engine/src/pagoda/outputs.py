"""What the engine hands back to callers: per-request outputs with text, tokens and timing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# One generated (or prompt) position: token id -> its logprob entry; the chosen token first.
PositionLogprobs = dict[int, "Logprob"]


@dataclass(slots=True)
class Logprob:
    """Log probability of one token at one position, with its rank (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: Optional[str] = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[PositionLogprobs]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[int | str] = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic()``) of a request's life."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request as seen by the caller after an engine step."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Set when the request failed on its own (finish_reason "error"): what went wrong, safe to show a client.
    error: Optional[str] = None
    # The failure is something the request needs being unavailable for now (an adapter whose files cannot be read),
    # not the request or the engine at fault: servers answer 503, and a retry may succeed.
    error_unavailable: bool = False
