"""Turning a sequence's tokens into text one step at a time, and finding stop strings in it.

Decoding token by token is wrong in two ways: sentencepiece decoders drop the leading space of
the first token they see, and a character spread over several byte-fallback tokens decodes to
U+FFFD until its last byte arrives. So, like vLLM, each step decodes a short window of recent
tokens (``prefix``, already turned into text, plus the tokens after it) and emits only what the
window adds beyond the prefix text, and only once it does not end in an incomplete character.
The first window starts in the tail of the prompt so the first output token is decoded in
context.

The window must stay short for decoding to stay linear in the output's length. A character is at
most 4 bytes, so at most 4 byte-fallback tokens; tokens that add no text (skipped special tokens)
or bytes that never form a character (invalid UTF-8) would otherwise grow it without bound, each
step decoding all of it again. So after ``_MAX_PENDING_TOKENS`` tokens without new complete text
the window is cut: at the latest point that decodes cleanly, else before the last 3 tokens (which
could still begin a character), emitting invalid bytes as U+FFFD.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from pagoda.sampling_params import SamplingParams

# How many prompt tokens the first window starts with (vLLM uses the same).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
_MAX_PENDING_TOKENS = 8
_MAX_CHAR_TOKENS = 4  # a UTF-8 character has at most 4 bytes, each at least one token


class IncrementalDetokenizer:
    """The text of one output sequence, grown token by token, with stop-string detection.

    ``output_text`` always holds the text of the tokens passed to :meth:`update` except for a
    trailing incomplete character; after a stop string is found it is truncated there.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.stop_string: Optional[str] = None  # the stop string that ended the sequence, if any
        # Tokens from the prefix offset on; window[:read] is already in output_text (or prompt).
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._prefix_text: Optional[str] = None  # decode(window[:read]), computed lazily
        self._emitted = 0  # characters of output_text already returned as deltas

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> Optional[str]:
        """Append tokens and extend ``output_text``; return the stop string if one now appears.

        When a stop string is found, ``output_text`` is truncated before it (or after it with
        ``include_stop_str_in_output``). ``stop_terminated`` says the last token is a stop token
        (EOS or one of ``stop_token_ids``); its text is left out unless
        ``include_stop_str_in_output``, as vLLM does.
        """
        assert self.stop_string is None, "update() after the sequence was stopped by a stop string"
        self.output_token_ids.extend(new_token_ids)
        text_ids = new_token_ids
        if stop_terminated and new_token_ids and not self.params.include_stop_str_in_output:
            text_ids = new_token_ids[:-1]
        length_before = len(self.output_text)
        for token_id in text_ids:
            self._append(token_id)
        # Like vLLM, stop strings count only once more than min_tokens tokens were generated.
        if not self.params.stop_strings or len(self.output_token_ids) <= self.params.min_tokens:
            return None
        return self._check_stop_strings(length_before)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to emit now: what is new since the last call (``delta``) or all of it.

        While not finished, the last ``max_stop_string_len - 1`` characters are held back: they
        could be the start of a stop string, which must never be half-streamed.
        """
        hold_back = 0 if finished else max(self.params.max_stop_string_len - 1, 0)
        end = max(len(self.output_text) - hold_back, 0)
        if not delta:
            return self.output_text[:end]
        start = self._emitted
        self._emitted = max(end, start)
        return self.output_text[start:end]

    def decode_token(self, token_id: int) -> str:
        """One token's text as it would read mid-sentence (leading space kept), for logprobs."""
        return _token_text(self.tokenizer, token_id)

    def _append(self, token_id: int) -> None:
        self._window.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        # Wait for more bytes while the window ends in an incomplete character.
        if len(full_text) > len(self._prefix_text) and not full_text.endswith(_REPLACEMENT_CHAR):
            self._advance(full_text, len(self._window))
        elif len(self._window) - self._read >= _MAX_PENDING_TOKENS:
            self._cut_window()

    def _advance(self, text: str, end: int) -> None:
        """Emit what ``text`` (the decoded ``window[:end]``) adds to the prefix text; the tokens just
        emitted become the next prefix: enough context, bounded window."""
        if len(text) > len(self._prefix_text):
            self.output_text += text[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        self._read = end - self._read
        self._prefix_text = None

    def _cut_window(self) -> None:
        """Too many tokens without new complete text: emit up to the latest clean cut that keeps at most
        the last 3 tokens pending, or, if none decodes cleanly, everything before those 3."""
        last = len(self._window)
        for end in range(last - 1, last - _MAX_CHAR_TOKENS, -1):
            text = self._decode(self._window[:end])
            if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT_CHAR):
                self._advance(text, end)
                return
        end = last - (_MAX_CHAR_TOKENS - 1)
        self._advance(self._decode(self._window[:end]), end)

    def _check_stop_strings(self, length_before: int) -> Optional[str]:
        """Find the earliest stop string that ends in the text added since ``length_before``."""
        text = self.output_text
        # A match must end in the new text, so it starts at most (len - 1) characters earlier.
        start = max(length_before - self.params.max_stop_string_len + 1, 0)
        best: Optional[tuple[int, str]] = None
        for stop in self.params.stop_strings:
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = text[: index + len(stop)] if self.params.include_stop_str_in_output else text[:index]
        self.stop_string = stop
        return stop

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.params.skip_special_tokens)


@functools.lru_cache(maxsize=1 << 16)
def _token_text(tokenizer: Any, token_id: int) -> str:
    """Decode ``token_id`` after an anchor token so decoders that strip a leading space do not."""
    anchor_ids, anchor_text = _anchor(tokenizer)
    if anchor_ids:
        text = tokenizer.decode(anchor_ids + [token_id], skip_special_tokens=False)
        if text.startswith(anchor_text):
            return text[len(anchor_text) :]
    return tokenizer.decode([token_id], skip_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _anchor(tokenizer: Any) -> tuple[list[int], str]:
    """A plain-text token to decode other tokens after, and its own text."""
    anchor_ids = tokenizer.encode("a", add_special_tokens=False)[-1:]
    return anchor_ids, tokenizer.decode(anchor_ids, skip_special_tokens=False)
