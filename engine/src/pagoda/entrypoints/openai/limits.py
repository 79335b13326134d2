"""What one request may ask of the server, checked before any expensive work (tokenizing, queueing).

Each limit is a ``pagoda serve`` flag. The checks run on the parsed body on the event loop and cost
O(number of list items), never O(text length) beyond ``len()``: a 20 MB prompt is refused in microseconds,
before it reaches a tokenizer. Admission then counts the sequences a request adds (prompts x n) against
``--max-num-queued-requests`` in one step, with no ``await`` between the check and the reservation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from pagoda.entrypoints.openai.defaults import (
    DEFAULT_HTTP_BODY_TIMEOUT,
    DEFAULT_HTTP_HEADER_TIMEOUT,
    DEFAULT_MAX_LOGIT_BIAS,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_N,
    DEFAULT_MAX_PENDING_COMPILES,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_STOP_SEQUENCES,
    DEFAULT_MAX_STRUCTURED_OUTPUT_CHARS,
    DEFAULT_MAX_TOOLS,
    DEFAULT_STRUCTURED_OUTPUT_COMPILE_TIMEOUT,
    PROMPT_CHARS_PER_TOKEN,
)
from pagoda.entrypoints.openai.errors import OpenAIError, bad_request, too_many_requests
from pagoda.tokenizer import iter_strings


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Per-request limits of the HTTP server (each a ``pagoda serve`` flag of the same name)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_prompt_chars: Optional[int] = None  # None: PROMPT_CHARS_PER_TOKEN x max_model_len
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES  # stop strings, and stop token ids, each
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
    max_n: int = DEFAULT_MAX_N
    http_header_timeout: float = DEFAULT_HTTP_HEADER_TIMEOUT
    http_body_timeout: float = DEFAULT_HTTP_BODY_TIMEOUT
    max_tools: int = DEFAULT_MAX_TOOLS
    max_structured_output_chars: int = DEFAULT_MAX_STRUCTURED_OUTPUT_CHARS  # a schema, regex, grammar or choices
    structured_output_compile_timeout: float = DEFAULT_STRUCTURED_OUTPUT_COMPILE_TIMEOUT
    max_pending_compiles: int = DEFAULT_MAX_PENDING_COMPILES  # output constraints compiling at once (then 429)

    def validate(self) -> None:
        """ValueError naming the flag of any limit that is not positive."""
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")

    def prompt_chars(self, max_model_len: int) -> int:
        """The prompt character limit in effect for a model of ``max_model_len`` tokens."""
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len


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
