"""What one request may ask of the server, checked before any expensive work (tokenizing, queueing).

Each limit is a ``pagoda serve`` flag (a field of :class:`~pagoda.entrypoints.openai.defaults.ServerLimits`). The
checks run on the parsed body on the event loop and cost O(number of list items), never O(text length) beyond
``len()``: a 20 MB prompt is refused in microseconds, before it reaches a tokenizer. Admission then counts the
sequences a request adds (prompts x n) against ``--max-num-queued-requests`` in one step, with no ``await`` between
the check and the reservation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from pagoda.entrypoints.openai.defaults import ServerLimits
from pagoda.entrypoints.openai.errors import OpenAIError, bad_request, too_many_requests
from pagoda.tokenizer import iter_strings


@dataclass(frozen=True, slots=True)
class RequestChecker:
    """The list and text limits of one server, with the prompt limit resolved for its model."""

    limits: ServerLimits
    max_prompt_chars: int

    def check_sampling(
        self,
        n: int,
        stop: Union[None, str, Sequence[str]],
        stop_token_ids: Optional[Sequence[int]],
        logit_bias: Optional[dict],
    ) -> None:
        """400 naming the field for ``n``, stop sequences or ``logit_bias`` beyond the limits."""
        limits = self.limits
        if n > limits.max_n:
            raise bad_request(f"n={n} exceeds the maximum of {limits.max_n} (--max-n).", param="n")
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        _check_count("stop", len(stops), limits.max_stop_sequences, "--max-stop-sequences")
        for text in stops:
            self._check_chars("stop", len(text))
        _check_count("stop_token_ids", len(stop_token_ids or ()), limits.max_stop_sequences, "--max-stop-sequences")
        _check_count("logit_bias", len(logit_bias or {}), limits.max_logit_bias, "--max-logit-bias")

    def check_prompts(self, prompts: Sequence[Union[str, list[int]]]) -> None:
        """400 for more prompts than allowed, or a text prompt longer than the character limit."""
        _check_count("prompt", len(prompts), self.limits.max_prompts_per_request, "--max-prompts-per-request")
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_chars("prompt", len(prompt))

    def check_messages(self, messages: Sequence[dict]) -> None:
        """400 for more messages than allowed, or more text in them than the character limit."""
        _check_count("messages", len(messages), self.limits.max_messages, "--max-messages")
        self._check_chars("messages", sum(_text_length(m) for m in messages))

    def check_tools(self, tools: Sequence[dict]) -> None:
        """400 for more tools than allowed, or more text in them than the character limit."""
        _check_count("tools", len(tools), self.limits.max_tools, "--max-tools")
        self._check_chars("tools", sum(_text_length(t) for t in tools))

    def check_structured_output(self, chars: int, param: Optional[str]) -> None:
        """400 for a constraint (schema, regex, grammar, choices) longer than the limit: compiling costs
        time on a shared thread that grows with it."""
        limit = self.limits.max_structured_output_chars
        if chars > limit:
            raise bad_request(
                f"{param} has {chars} characters; at most {limit} are accepted (--max-structured-output-chars).",
                param=param,
            )

    def _check_chars(self, param: str, length: int) -> None:
        if length > self.max_prompt_chars:
            raise OpenAIError(
                400,
                f"{param} has {length} characters; this server accepts at most {self.max_prompt_chars} "
                "(--max-prompt-chars).",
                param=param,
                code="prompt_too_long",
            )


class AdmissionControl:
    """Counts the sequences waiting for the engine, plus those of requests still being prepared.

    ``reserve(k)`` runs on the event loop with no ``await`` inside, so a burst of handlers sees each
    other's reservations. A request keeps its reservation while it is tokenized, and gives it back once its
    sequences are in the engine's own count (or it failed).
    """

    def __init__(self, max_waiting: int, engine_waiting) -> None:
        """``engine_waiting()`` is the engine's count of waiting sequences."""
        self.max_waiting = max_waiting
        self._engine_waiting = engine_waiting
        self.reserved = 0

    @property
    def num_waiting(self) -> int:
        return self._engine_waiting() + self.reserved

    def reserve(self, num_seqs: int) -> Reservation:
        """Reserve ``num_seqs`` places: 400 if a request that big can never wait, 429 if the queue is full."""
        if num_seqs > self.max_waiting:
            raise bad_request(
                f"this request adds {num_seqs} sequences (prompts x n); at most {self.max_waiting} can wait "
                "(--max-num-queued-requests). Split it into smaller requests.",
                param="n",
            )
        if self.num_waiting + num_seqs > self.max_waiting:
            raise too_many_requests(1)
        self.reserved += num_seqs
        return Reservation(self, num_seqs)


class Reservation:
    """Places held in an :class:`AdmissionControl`; ``release()`` (idempotent) gives them back."""

    __slots__ = ("_control", "_num_seqs")

    def __init__(self, control: AdmissionControl, num_seqs: int) -> None:
        self._control = control
        self._num_seqs = num_seqs

    def release(self) -> None:
        self._control.reserved -= self._num_seqs
        self._num_seqs = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _check_count(param: str, count: int, limit: int, flag: str) -> None:
    if count > limit:
        raise bad_request(f"{param} has {count} entries; at most {limit} are accepted ({flag}).", param=param)


def _text_length(message: object) -> int:
    """Characters of every string inside a message (content, parts, names, tool calls)."""
    return sum(len(text) for text in iter_strings(message))
