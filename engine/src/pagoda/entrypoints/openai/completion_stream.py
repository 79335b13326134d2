"""The choices of ``POST /v1/completions``, whole and as Server-Sent Event chunks: echo, logprobs over prompt and
output (see :mod:`completion_logprobs`), vLLM's ``prompt_logprobs``, and ``max_tokens`` 0 with ``echo``.

``max_tokens`` 0 with ``echo`` scores the prompt without generating: the engine runs the request with
``max_tokens`` 1 (its prompt logprobs come from that one forward pass over the prompt) and the token it samples is
dropped here: from the text, the logprobs and the usage, which counts 0 completion tokens.

Streamed, the echo is its own chunk per choice, before the generated text; when logprobs are asked for it waits
for the engine's first output, which carries the prompt's logprobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.entrypoints.openai.completion_logprobs import (
    CompletionLogprobs,
    TokenText,
    offsets_of,
    prompt_logprobs_body,
    whole_logprobs,
)
from pagoda.entrypoints.openai.responses import StreamUsage, merge_streams
from pagoda.entrypoints.openai.serving_base import ServingBase, Sub
from pagoda.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagoda.sampling_params import SamplingParams

# Tokens of context a streamed choice keeps to read its next tokens in (the detokenizer uses the last 5).
_CONTEXT_TOKENS = 8


@dataclass(frozen=True, slots=True)
class CompletionShape:
    """What a completions request asks its choices to hold."""

    echo: bool
    echo_only: bool  # echo with max_tokens 0: the generated token is dropped
    logprobs: Optional[int]  # None: no logprobs
    text: TokenText


async def completion_choice(
    shape: CompletionShape, sub: Sub, output: RequestOutput, c: CompletionOutput, echo_text: str
) -> dict[str, Any]:
    """One finished choice (``echo_text``: the prompt text to echo when no logprobs are asked for)."""
    output_ids, output_entries, output_text = (
        ([], [], "") if shape.echo_only else (c.token_ids, c.logprobs or [], c.text)
    )
    logprobs = None
    if shape.logprobs is None:
        text = echo_text + output_text
    else:
        prompt_entries = (output.prompt_logprobs or []) if shape.echo else None
        text, logprobs = await asyncio.to_thread(
            whole_logprobs,
            shape.text,
            shape.logprobs,
            sub.prompt,
            sub.prompt_ids,
            prompt_entries,
            output_ids,
            output_entries,
            output_text,
        )
    return {
        "index": sub.index_base + c.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "prompt_logprobs": prompt_logprobs_body(output.prompt_logprobs),
    }


@dataclass(slots=True)
class _StreamedChoice:
    """Where a streamed choice's next tokens start: their context and their offset in the choice's text."""

    context: list[int]
    offset: int

    def logprobs(self, text: TokenText, k: int, token_ids: list[int], entries: list[Optional[PositionLogprobs]]):
        pieces = text.pieces(self.context, token_ids)
        logprobs = CompletionLogprobs()
        logprobs.add(text, token_ids, entries, k, offsets_of(pieces, self.offset))
        self.context = (self.context + list(token_ids))[-_CONTEXT_TOKENS:]
        self.offset += sum(len(piece) for piece in pieces)
        return logprobs.body()


async def completion_chunks(
    serving: ServingBase,
    subs: list[Sub],
    params: SamplingParams,
    shape: CompletionShape,
    ident: tuple[str, int],
    include_usage: bool,
) -> AsyncIterator[dict]:
    """The chunks of a streamed completion (``ident``: the response id and its creation time)."""
    response_id, created = ident
    model = subs[0].model

    def chunk(index: int, text: str, logprobs: Optional[dict], c: Optional[CompletionOutput] = None) -> dict:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason if c is not None else None,
            "stop_reason": c.stop_reason if c is not None else None,
        }
        return {"id": response_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}

    if shape.echo and shape.logprobs is None:
        for sub in subs:
            text = await serving.prompt_text(sub)
            for i in range(params.n):
                yield chunk(sub.index_base + i, text, None)
    choices: dict[int, _StreamedChoice] = {}
    echoed: set[str] = set()
    stream_usage = StreamUsage()
    async for sub, output in merge_streams((s, serving.stream(s, params)) for s in subs):
        stream_usage.add(output, completion=not shape.echo_only)
        if shape.echo and shape.logprobs is not None and sub.request_id not in echoed:
            echoed.add(sub.request_id)
            prefix, body = await _echo_logprobs(shape, sub, output)
            for i in range(params.n):
                choices[sub.index_base + i] = _StreamedChoice(list(sub.prompt_ids[-_CONTEXT_TOKENS:]), len(prefix))
                yield chunk(sub.index_base + i, prefix, body)
        for c in output.outputs:
            index = sub.index_base + c.index
            if shape.echo_only:
                if c.finished:
                    yield chunk(index, "", CompletionLogprobs().body() if shape.logprobs is not None else None, c)
                continue
            logprobs = None
            if shape.logprobs is not None:
                choice = choices.setdefault(index, _StreamedChoice(list(sub.prompt_ids[-_CONTEXT_TOKENS:]), 0))
                logprobs = await asyncio.to_thread(
                    choice.logprobs, shape.text, shape.logprobs, c.token_ids, c.logprobs or []
                )
            yield chunk(index, c.text, logprobs, c)
    if include_usage:
        yield {**chunk(0, "", None), "choices": [], "usage": stream_usage.body()}


async def _echo_logprobs(shape: CompletionShape, sub: Sub, output: RequestOutput) -> tuple[str, dict[str, Any]]:
    """(the echoed prompt text, its logprobs) from the engine's first output of ``sub``."""
    assert shape.logprobs is not None
    return await asyncio.to_thread(
        whole_logprobs, shape.text, shape.logprobs, sub.prompt, sub.prompt_ids, output.prompt_logprobs or [], [], [], ""
    )
