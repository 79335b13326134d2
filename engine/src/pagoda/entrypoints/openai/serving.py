"""The OpenAI completion and chat endpoints on top of AsyncLLMEngine (JSON and Server-Sent Events)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import apply_chat_template

Prompt = Union[str, list[int]]


@dataclass(slots=True)
class _Sub:
    """One engine request behind an HTTP request (a completions call with k prompts has k)."""

    request_id: str
    prompt: Prompt
    index_base: int  # choice index = index_base + completion index
    stream: Optional[RequestStream] = None  # set by OpenAIServing._submit


class OpenAIServing:
    """Turns validated requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, chat_template: Optional[str], metrics=None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template
        self.metrics = metrics
        self.tokenizer = engine.engine.tokenizer

    # ---- completions ---------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request):
        params = self._params(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = body.prompts()
        subs = [_Sub(f"{request_id}-{i}", p, i * params.n) for i, p in enumerate(prompts)]
        self._submit(subs, params)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._completion_chunks(subs, params, request_id, created, include_usage, body.echo)
            return _sse(chunks)
        finals = await _until_disconnected(raw, asyncio.gather(*(self._final(s, params) for s in subs)))
        choices = []
        for sub, output in zip(subs, finals):
            for c in output.outputs:
                text = (_prompt_text(self.tokenizer, output) if body.echo else "") + c.text
                logprobs = _completion_logprobs(c) if params.logprobs is not None else None
                choices.append(
                    {
                        "index": sub.index_base + c.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": sorted(choices, key=lambda c: c["index"]),
                "usage": _usage(finals),
            }
        )

    async def _completion_chunks(
        self, subs: list[_Sub], params: SamplingParams, request_id: str, created: int, include_usage: bool, echo: bool
    ) -> AsyncIterator[dict]:
        def chunk(index: int, text: str, c: Optional[CompletionOutput]) -> dict:
            return {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": _completion_logprobs(c) if c is not None and params.logprobs is not None else None,
                        "finish_reason": c.finish_reason if c is not None else None,
                        "stop_reason": c.stop_reason if c is not None else None,
                    }
                ],
            }

        if echo:
            for sub in subs:
                text = sub.prompt if isinstance(sub.prompt, str) else self.tokenizer.decode(sub.prompt)
                for i in range(params.n):
                    yield chunk(sub.index_base + i, text, None)
        usage = _StreamUsage()
        async for sub, output in _merge((s, self._stream(s, params)) for s in subs):
            usage.add(output)
            for c in output.outputs:
                yield chunk(sub.index_base + c.index, c.text, c)
        if include_usage:
            yield {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage.body(),
            }

    # ---- chat ----------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        params = self._params(body)
        try:
            prompt_ids = apply_chat_template(self.tokenizer, body.messages, self.chat_template, True)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        sub = _Sub(request_id, prompt_ids, 0)
        self._submit([sub], params)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(self._chat_chunks(sub, params, created, include_usage))
        output = await _until_disconnected(raw, self._final(sub, params))
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c, params.logprobs) if params.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ]
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": _usage([output]),
            }
        )

    async def _chat_chunks(
        self, sub: _Sub, params: SamplingParams, created: int, include_usage: bool
    ) -> AsyncIterator[dict]:
        def chunk(choices: list[dict], **extra) -> dict:
            return {
                "id": sub.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                **extra,
            }

        yield chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(params.n)
            ]
        )
        usage = _StreamUsage()
        async for output in self._stream(sub, params):
            usage.add(output)
            for c in output.outputs:
                choice = {
                    "index": c.index,
                    "delta": {"content": c.text} if c.text or not c.finished else {},
                    "logprobs": _chat_logprobs(c, params.logprobs) if params.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                }
                yield chunk([choice])
        if include_usage:
            yield chunk([], usage=usage.body())

    # ---- shared --------------------------------------------------------------------------

    def _params(self, body: Union[CompletionRequest, ChatCompletionRequest]) -> SamplingParams:
        defaults = self.engine.engine.model_config.generation_defaults
        if self.engine.engine.args.generation_config == "vllm":
            defaults = {}
        # raises OpenAIError (400 naming the field) for values SamplingParams rejects
        return body.to_sampling_params(None, defaults)

    async def _final(self, sub: _Sub, params: SamplingParams) -> RequestOutput:
        final = None
        async for output in self._stream(sub, params):
            final = output
        assert final is not None and final.finished
        return final

    def _submit(self, subs: list[_Sub], params: SamplingParams) -> None:
        """Queue the engine requests at once, with no ``await`` since the admission check: a burst of
        handlers in one event-loop iteration then sees each other in ``num_waiting``."""
        try:
            for sub in subs:
                sub.stream = self.engine.submit(sub.request_id, sub.prompt, params)
        except EngineDeadError as exc:
            for sub in subs:
                if sub.stream is not None:
                    sub.stream.close()
            raise OpenAIError(503, f"the request was not accepted: {exc}", type="service_unavailable") from None

    async def _stream(self, sub: _Sub, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        assert sub.stream is not None, "submit before streaming"
        finished = False
        try:
            async for output in sub.stream:
                if self.metrics is not None:
                    self.metrics.record_output(output, time.monotonic(), params.output_kind)
                finished = output.finished
                yield output
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="prompt" if "prompt" in str(exc) else None) from None
        except EngineDeadError as exc:
            raise OpenAIError(503, f"the request was aborted: {exc}", type="service_unavailable") from None
        finally:
            sub.stream.close()  # aborts now, not when the generator is collected, if we stopped early
            if not finished and self.metrics is not None:
                self.metrics.record_abort(sub.request_id)


async def _merge(streams) -> AsyncIterator[tuple[_Sub, RequestOutput]]:
    """Interleave several ``(sub, engine stream)`` pairs as their outputs arrive."""
    streams = list(streams)
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(sub, stream):
        try:
            async for item in stream:
                await queue.put((sub, item))
        except BaseException as exc:  # surface errors (e.g. a bad prompt) to the consumer
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(sub, stream)) for sub, stream in streams]
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


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-Sent Events in OpenAI's framing; an error mid-stream becomes an error event."""

    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except OpenAIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _until_disconnected(raw: Request, awaitable):
    """Await ``awaitable`` unless the client goes away first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()


@dataclass(slots=True)
class _StreamUsage:
    """Token counts over the DELTA outputs of one or more streamed requests."""

    prompt_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, output: RequestOutput) -> None:
        self.prompt_tokens[output.request_id] = len(output.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def body(self) -> dict[str, int]:
        prompt = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prompt_text(tokenizer, output: RequestOutput) -> str:
    return output.prompt if output.prompt is not None else tokenizer.decode(output.prompt_token_ids)


def _completion_logprobs(c: CompletionOutput) -> dict[str, Any]:
    """The legacy completions shape: parallel lists plus a dict of top alternatives per token."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(c: CompletionOutput, top_k: int) -> dict[str, Any]:
    """Chat shape: per token, the chosen one and the ``top_k`` most likely (by rank)."""

    def item(lp) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for lp in ranked[:top_k]]})
    return {"content": content}
