"""Sampling parameters of one request, validated on construction (ValueError for bad input)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagoda.structured_output.params import StructuredOutputsParams

_EPS = 1e-5

# Bounds shared with the OpenAI API's schema (protocol.py), so the served document states what is enforced.
# Above MAX_TEMPERATURE sampling is uniform for any practical purpose; the bound keeps ``logits / T`` finite
# in float32. Repetition penalties outside [MIN, MAX] only flatten or saturate logits (1e-300 underflows to 0
# in float32 and turned them into inf/NaN). A seed seeds a torch.Generator: int64.
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1


class RequestOutputKind(enum.Enum):
    """What each incremental output of a request carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, with vLLM's names and defaults.

    ``temperature == 0`` means greedy. ``max_tokens=None`` means "up to the model's
    maximum length". ``seed`` makes the request's random draws reproducible and independent
    of what else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a JSON Schema, any JSON object, a regex, a choice or a grammar (vLLM's name).
    structured_outputs: Optional[StructuredOutputsParams] = None
    # vLLM's masks: only these token ids may be sampled; these words are never completed (see resolve_bad_words).
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    # The token sequences of ``bad_words``, set from the tokenizer when the engine takes the request.
    bad_words_token_ids: Optional[list[list[int]]] = None
    # Normalised forms, derived in __post_init__.
    stop_strings: list[str] = field(default_factory=list, init=False)
    all_stop_token_ids: frozenset[int] = field(default_factory=frozenset, init=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            _check(
                self.stop is None or isinstance(self.stop, (list, tuple)), "stop must be a string or a list of strings."
            )
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = _parse_logit_bias(self.logit_bias)
        self._validate()
        self.all_stop_token_ids = frozenset(self.stop_token_ids)
        if self.temperature < _EPS:
            # Greedy: the filters cannot change the argmax; normalise them away.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def max_stop_string_len(self) -> int:
        return max((len(s) for s in self.stop_strings), default=0)

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}.")
        _check(
            _is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
            f"temperature must be a non-negative number of at most {MAX_TEMPERATURE:g}, got {self.temperature}.",
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}.",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        _check(
            -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
        )
        _check(
            _is_number(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
            f"got {self.repetition_penalty}.",
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be at least 1, got {self.max_tokens}.",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be non-negative, got {self.min_tokens}.",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and value >= 0), f"{name} must be non-negative, got {value}."
            )
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop strings must be non-empty strings.")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers.",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and MIN_SEED <= self.seed <= MAX_SEED - self.n),
            f"seed must be an integer in [{MIN_SEED}, {MAX_SEED - self.n}], got {self.seed!r}.",
        )
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams.",
        )
        _check(
            self.structured_outputs is None or self.min_tokens == 0,
            "min_tokens cannot be combined with structured outputs: once the constrained output is complete only "
            "the end of the sequence is allowed, which min_tokens forbids.",
        )
        self._validate_masks()
        for token_id, bias in (self.logit_bias or {}).items():
            _check(
                -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                f"logit_bias for token {token_id} must be in [-100, 100], got {bias}.",
            )

    def _validate_masks(self) -> None:
        _check(
            self.allowed_token_ids is None
            or (
                isinstance(self.allowed_token_ids, list)
                and bool(self.allowed_token_ids)
                and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)
            ),
            "allowed_token_ids must be a non-empty list of non-negative token ids.",
        )
        _check(
            self.bad_words is None
            or (isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
            "bad_words must be a list of non-blank strings.",
        )


def _parse_logit_bias(logit_bias: object) -> dict[int, float]:
    """Token ids may arrive as strings (JSON object keys); biases must be finite numbers."""
    _check(isinstance(logit_bias, dict), "logit_bias must be a mapping of token id to bias.")
    parsed = {}
    for key, value in logit_bias.items():  # type: ignore[attr-defined]
        try:
            if isinstance(key, float) and not key.is_integer():
                raise ValueError
            token_id, bias = int(key), float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"logit_bias entries must map integer token ids to numbers, got {key!r}: {value!r}."
            ) from None
        _check(token_id >= 0, f"logit_bias token ids must be non-negative, got {token_id}.")
        parsed[token_id] = bias
    return parsed


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def validate_for_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Reject (ValueError) token ids in ``params`` that the model's vocabulary does not have.

    SamplingParams cannot check this alone; the engine calls it when a request arrives so a
    bad request is refused instead of failing a whole batch in the sampler.
    """
    for name, ids in (
        ("logit_bias", params.logit_bias or {}),
        ("stop_token_ids", params.stop_token_ids or []),
        ("allowed_token_ids", params.allowed_token_ids or []),
    ):
        bad = sorted(t for t in ids if not 0 <= t < vocab_size)
        if bad:
            raise ValueError(f"{name} has token ids outside the vocabulary (size {vocab_size}): {bad[:10]}.")


def resolve_bad_words(params: SamplingParams, tokenizer: Any) -> None:
    """Set ``params.bad_words_token_ids`` from ``params.bad_words``, as vLLM does: each word's tokens as written
    (leading spaces stripped) and, with one leading space (the word mid-sentence), when that gives as many tokens
    but a different first one. The sampler then forbids a sequence's last token wherever the output ends with the
    tokens before it."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return
    sequences: list[list[int]] = []
    for word in params.bad_words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if plain:
            sequences.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(spaced)
    params.bad_words_token_ids = sequences
