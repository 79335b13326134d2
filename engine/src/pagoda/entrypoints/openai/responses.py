"""Shaping engine outputs into OpenAI response bodies: usage, logprobs, and Server-Sent Events."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

SSE_MEDIA_TYPE = "text/event-stream"
# The status a client that went away is logged with (nginx's "client closed request"); nobody receives it.
CLIENT_CLOSED_REQUEST = 499


async def merge_streams(streams) -> AsyncIterator[tuple[Any, RequestOutput]]:
    """Interleave several ``(key, async iterator)`` pairs as their items arrive."""
    streams = list(streams)
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(key, stream):
        try:
            async for item in stream:
                await queue.put((key, item))
        except BaseException as exc:  # surface errors (an OpenAIError, a cancellation) to the consumer
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(key, stream)) for key, stream in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def sse_response(chunks: AsyncIterator[dict], request_id: str) -> StreamingResponse:
    """Server-Sent Events in OpenAI's framing. Every error a request can get before its first token has
    been answered as a status code already; one after that (the engine stopped) becomes an error event."""

    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, allow_nan=False)}\n\n"
        except OpenAIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            logger.info("request_id=%s: the client disconnected mid-stream; its request was aborted", request_id)
            raise
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type=SSE_MEDIA_TYPE, headers={"Cache-Control": "no-cache"})


@dataclass(slots=True)
class StreamUsage:
    """Token counts over the DELTA outputs of one or more streamed requests."""

    prompt_tokens: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, output: RequestOutput, completion: bool = True) -> None:
        """Count ``output`` (``completion`` False: its tokens are dropped, as ``max_tokens`` 0 with echo does)."""
        self.prompt_tokens[output.request_id] = len(output.prompt_token_ids)
        self.cached_tokens[output.request_id] = output.num_cached_tokens
        if completion:
            self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def body(self) -> dict[str, Any]:
        return _usage_body(sum(self.prompt_tokens.values()), self.completion_tokens, sum(self.cached_tokens.values()))


def usage(outputs: list[RequestOutput], completion: bool = True) -> dict[str, Any]:
    """OpenAI's ``usage`` of finished outputs, with ``prompt_tokens_details.cached_tokens`` (prefix-cache hits);
    ``completion`` False counts no completion tokens (their tokens were dropped)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs) if completion else 0
    return _usage_body(prompt, generated, sum(o.num_cached_tokens for o in outputs))


def _usage_body(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_logprobs(c: CompletionOutput, top_k: int, as_token_ids: bool = False) -> dict[str, Any]:
    """Chat shape: per token, the chosen one and the ``top_k`` most likely (by rank); ``as_token_ids`` names tokens
    ``token_id:N`` (``return_tokens_as_token_ids``)."""

    def item(token_id: int, lp) -> dict[str, Any]:
        text = f"token_id:{token_id}" if as_token_ids else (lp.decoded_token or "")
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode(errors="replace"))}

    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)
        content.append({**item(token_id, entry[token_id]), "top_logprobs": [item(t, lp) for t, lp in ranked[:top_k]]})
    return {"content": content}


async def until_disconnected(raw: Request, request_id: str, awaitable: Awaitable) -> Any:
    """Await ``awaitable`` unless the client goes away first: then cancel it (which aborts its requests),
    log one line, and return None."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await raw.is_disconnected():
                logger.info("request_id=%s: the client disconnected before the response; request aborted", request_id)
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # retrieve it: no "never retrieved" tracebacks
