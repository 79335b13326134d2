"""The plan of one step (scheduler -> model runner) and its result (model runner -> scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.outputs import PositionLogprobs
from pagoda.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """Compute ``num_tokens`` tokens of ``request`` starting at its ``num_computed_tokens``."""

    request: Request
    num_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled after it."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the model runner needs for one forward pass."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens per sequence (``n`` of them for a sequence about to be forked)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # Sequences that got no token this step, with the reason: the engine fails their requests alone.
    errors: dict[str, str] = field(default_factory=dict)
