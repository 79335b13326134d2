"""The logprobs of legacy completions (``echo`` included) and vLLM's ``prompt_logprobs``, as OpenAI and vLLM shape
them.

A completion's ``logprobs`` are parallel lists over its tokens: ``tokens`` (each token's text, or ``token_id:N``
with ``return_tokens_as_token_ids``), ``token_logprobs``, ``top_logprobs`` (the chosen token and the ``logprobs``
most likely, by text) and ``text_offset``. With ``echo`` they cover the prompt too, its first token with null
logprobs (nothing comes before it). ``text_offset`` points into the choice's text: each token's offset is where the
text it adds starts, so slicing the text between two offsets gives what that token added. What a token adds is
read with the engine's own incremental detokenizer, in context (the leading space a sentencepiece token has
mid-text, a character spread over byte tokens given to the token that completes it).

Decoding runs on a worker thread (``asyncio.to_thread``) with the engine's tokenizer, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.outputs import PositionLogprobs
from pagoda.sampling_params import SamplingParams

TOKEN_ID_PREFIX = "token_id:"


def token_name(token_id: int, decoded: Optional[str], as_token_ids: bool) -> str:
    """How a token is named in logprobs: its text, or ``token_id:N``."""
    return f"{TOKEN_ID_PREFIX}{token_id}" if as_token_ids else (decoded or "")


@dataclass(frozen=True, slots=True)
class TokenText:
    """What a request's tokens read as: the tokenizer, the request's special-token settings, and whether logprobs
    name tokens by id."""

    tokenizer: Any
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    as_token_ids: bool = False

    def pieces(
        self, context_ids: list[int], token_ids: list[int], skip_special_tokens: Optional[bool] = None
    ) -> list[str]:
        """The text each of ``token_ids`` adds after ``context_ids`` (one string per token, possibly empty)."""
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        params = SamplingParams(
            max_tokens=None, skip_special_tokens=skip, spaces_between_special_tokens=self.spaces_between_special_tokens
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, context_ids, params)
        pieces = []
        for token_id in token_ids:
            before = len(detokenizer.output_text)
            detokenizer.update([token_id])
            pieces.append(detokenizer.output_text[before:])
        return pieces

    def decode_token(self, token_id: int) -> str:
        """One token's text on its own (the first prompt token's, which has no logprob entry)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass(slots=True)
class CompletionLogprobs:
    """The four parallel lists, grown span by span (the prompt, then output deltas)."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[Optional[float]] = field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(
        self,
        text: TokenText,
        token_ids: list[int],
        entries: list[Optional[PositionLogprobs]],
        k: int,
        offsets: list[int],
    ) -> None:
        """Append ``token_ids`` with their logprob entries (None: no logprob, the first prompt token) and offsets;
        ``top_logprobs`` holds the chosen token and at most ``k`` more, as OpenAI's ``logprobs`` parameter says."""
        for token_id, entry, offset in zip(token_ids, entries, offsets):
            self.text_offset.append(offset)
            if entry is None or token_id not in entry:
                self.tokens.append(token_name(token_id, text.decode_token(token_id), text.as_token_ids))
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            chosen = entry[token_id]
            self.tokens.append(token_name(token_id, chosen.decoded_token, text.as_token_ids))
            self.token_logprobs.append(max(chosen.logprob, -9999.0))
            top = list(entry.items())[: k + 1]
            self.top_logprobs.append(
                {token_name(t, lp.decoded_token, text.as_token_ids): max(lp.logprob, -9999.0) for t, lp in top}
            )

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def offsets_of(pieces: list[str], base: int, limit: Optional[int] = None) -> list[int]:
    """Where each piece starts in a text that has ``base`` characters before the first (at most ``limit``: a stop
    string cut the text short of the tokens' own text)."""
    offsets, position = [], base
    for piece in pieces:
        offsets.append(position if limit is None else min(position, limit))
        position += len(piece)
    return offsets


def echoed_prompt(text: TokenText, prompt: Any, prompt_ids: list[int]) -> tuple[str, list[str]]:
    """(the prompt text a choice echoes, what each prompt token adds to it). A text prompt echoes as sent; a
    token-id prompt as its tokens read, special tokens included (as vLLM decodes it)."""
    if isinstance(prompt, str):
        return prompt, text.pieces([], prompt_ids)
    pieces = text.pieces([], prompt_ids, skip_special_tokens=False)
    return "".join(pieces), pieces


def whole_logprobs(
    text: TokenText,
    k: int,
    prompt: Any,
    prompt_ids: list[int],
    prompt_entries: Optional[list[Optional[PositionLogprobs]]],
    output_ids: list[int],
    output_entries: list[Optional[PositionLogprobs]],
    output_text: str,
) -> tuple[str, dict[str, Any]]:
    """(the choice's text, its ``logprobs``) for a finished choice; ``prompt_entries`` None: no echo."""
    logprobs = CompletionLogprobs()
    prefix = ""
    if prompt_entries is not None:
        prefix, pieces = echoed_prompt(text, prompt, prompt_ids)
        entries = list(prompt_entries) + [None] * (len(prompt_ids) - len(prompt_entries))
        logprobs.add(text, prompt_ids, entries, k, offsets_of(pieces, 0, len(prefix)))
    full = prefix + output_text
    pieces = text.pieces(prompt_ids, output_ids)
    logprobs.add(text, output_ids, output_entries, k, offsets_of(pieces, len(prefix), len(full)))
    return full, logprobs.body()


def prompt_logprobs_body(entries: Optional[list[Optional[PositionLogprobs]]]) -> Optional[list[Optional[dict]]]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first null), token id (a string) -> logprob, rank and
    decoded token."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]
