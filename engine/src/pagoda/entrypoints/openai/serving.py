"""The OpenAI completion, chat and tokenizer endpoints on top of AsyncLLMEngine (JSON and Server-Sent Events).

Every request goes through the same stages, all finished before a response (streamed or not) starts, so
a streamed request gets the same 4xx as a plain one:

1. limits (:mod:`limits`): list lengths, characters, ``n`` - microseconds, before any real work;
2. admission: its prompts x n sequences are reserved against ``--max-num-queued-requests`` (429 if full);
3. tokenizing or chat-template rendering on the tokenizer pool (never the event loop or engine thread);
4. the engine's own checks (context length, token ids), then submission and the engine's acknowledgement.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError, RequestStream
from pagoda.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    internal_error,
    sampling_error,
    service_unavailable,
)
from pagoda.entrypoints.openai.http_guards import request_id_of
from pagoda.entrypoints.openai.limits import AdmissionControl, RequestChecker
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    message_dicts,
)
from pagoda.entrypoints.openai.responses import (
    CLIENT_CLOSED_REQUEST,
    StreamUsage,
    chat_logprobs,
    completion_logprobs,
    merge_streams,
    sse_response,
    until_disconnected,
    usage,
)
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool, TokenizerPoolError
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]


@dataclass(slots=True)
class _Sub:
    """One engine request behind an HTTP request (a completions call with k prompts has k)."""

    request_id: str
    prompt: Prompt
    prompt_ids: list[int]
    index_base: int  # choice index = index_base + completion index
    stream: Optional[RequestStream] = None  # set by OpenAIServing._submit


class OpenAIServing:
    """Turns validated requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        pool: TokenizerPool,
        checker: RequestChecker,
        admission: AdmissionControl,
        metrics=None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.pool = pool
        self.checker = checker
        self.admission = admission
        self.metrics = metrics
        self._engine_ids = itertools.count()

    # ---- completions ---------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        request_id = request_id_of(raw.scope)
        params = self._params(body)
        prompts = body.prompts()
        self.checker.check_prompts(prompts)
        self._check_sampling(body, params)
        with self.admission.reserve(len(prompts) * params.n):
            prompt_ids = await self._tokenize(prompts)
            subs = [
                _Sub(self._engine_id("cmpl", request_id), p, ids, i * params.n)
                for i, (p, ids) in enumerate(zip(prompts, prompt_ids))
            ]
            self._submit(subs, params)
        await self._admitted(subs)
        response_id, created = f"cmpl-{request_id}", int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._completion_chunks(subs, params, response_id, created, include_usage, body.echo)
            return sse_response(chunks, request_id)
        finals = await until_disconnected(raw, request_id, asyncio.gather(*(self._final(s, params) for s in subs)))
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = []
        for sub, output in zip(subs, finals):
            echo = (await self._prompt_text(sub)) if body.echo else ""
            for c in output.outputs:
                choices.append(
                    {
                        "index": sub.index_base + c.index,
                        "text": echo + c.text,
                        "logprobs": completion_logprobs(c) if params.logprobs is not None else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return JSONResponse(
            {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": sorted(choices, key=lambda c: c["index"]),
                "usage": usage(finals),
            }
        )

    async def _completion_chunks(
        self, subs: list[_Sub], params: SamplingParams, response_id: str, created: int, include_usage: bool, echo: bool
    ) -> AsyncIterator[dict]:
        def chunk(index: int, text: str, c: Optional[CompletionOutput]) -> dict:
            return {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": completion_logprobs(c) if c is not None and params.logprobs is not None else None,
                        "finish_reason": c.finish_reason if c is not None else None,
                        "stop_reason": c.stop_reason if c is not None else None,
                    }
                ],
            }

        if echo:
            for sub in subs:
                text = await self._prompt_text(sub)
                for i in range(params.n):
                    yield chunk(sub.index_base + i, text, None)
        stream_usage = StreamUsage()
        async for sub, output in merge_streams((s, self._stream(s, params)) for s in subs):
            stream_usage.add(output)
            for c in output.outputs:
                yield chunk(sub.index_base + c.index, c.text, c)
        if include_usage:
            yield {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": stream_usage.body(),
            }

    # ---- chat ----------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        request_id = request_id_of(raw.scope)
        params = self._params(body)
        messages = message_dicts(body.messages)
        self.checker.check_messages(messages)
        self._check_sampling(body, params)
        with self.admission.reserve(params.n):
            try:
                prompt_ids = await self.pool.render_chat(messages, body.add_generation_prompt)
            except ValueError as exc:
                raise bad_request(str(exc), param="messages") from None
            except TokenizerPoolError as exc:
                raise internal_error(str(exc)) from None
            sub = _Sub(self._engine_id("chatcmpl", request_id), prompt_ids, prompt_ids, 0)
            self._submit([sub], params)
        await self._admitted([sub])
        response_id, created = f"chatcmpl-{request_id}", int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse_response(self._chat_chunks(sub, params, response_id, created, include_usage), request_id)
        output = await until_disconnected(raw, request_id, self._final(sub, params))
        if output is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, params.logprobs) if params.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ]
        return JSONResponse(
            {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": usage([output]),
            }
        )

    async def _chat_chunks(
        self, sub: _Sub, params: SamplingParams, response_id: str, created: int, include_usage: bool
    ) -> AsyncIterator[dict]:
        def chunk(choices: list[dict], **extra) -> dict:
            return {
                "id": response_id,
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
        stream_usage = StreamUsage()
        async for output in self._stream(sub, params):
            stream_usage.add(output)
            for c in output.outputs:
                choice = {
                    "index": c.index,
                    "delta": {"content": c.text} if c.text or not c.finished else {},
                    "logprobs": chat_logprobs(c, params.logprobs) if params.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                }
                yield chunk([choice])
        if include_usage:
            yield chunk([], usage=stream_usage.body())

    # ---- tokenizer endpoints ---------------------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        try:
            if body.messages is not None:
                messages = message_dicts(body.messages)
                self.checker.check_messages(messages)
                tokens = await self.pool.render_chat(messages, body.add_generation_prompt)
            else:
                assert body.prompt is not None
                self.checker.check_prompts([body.prompt])
                tokens = await self.pool.encode(body.prompt, body.add_special_tokens)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages" if body.messages is not None else "prompt") from None
        except TokenizerPoolError as exc:
            raise internal_error(str(exc)) from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.engine.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        try:
            return {"prompt": await self.pool.decode(body.tokens)}
        except TokenizerPoolError as exc:
            raise internal_error(str(exc)) from None

    # ---- shared --------------------------------------------------------------------------

    def _params(self, body: Union[CompletionRequest, ChatCompletionRequest]) -> SamplingParams:
        defaults = self.engine.engine.model_config.generation_defaults
        if self.engine.engine.args.generation_config == "vllm":
            defaults = {}
        # raises OpenAIError (400 naming the field) for values SamplingParams rejects
        return body.to_sampling_params(None, defaults)

    def _check_sampling(self, body: Union[CompletionRequest, ChatCompletionRequest], params: SamplingParams) -> None:
        self.checker.check_sampling(params.n, body.stop, body.stop_token_ids, body.logit_bias)

    def _engine_id(self, kind: str, request_id: str) -> str:
        # Unique even when clients reuse an X-Request-Id, and still found in the logs by it.
        return f"{kind}-{request_id}-{next(self._engine_ids)}"

    async def _tokenize(self, prompts: list[Prompt]) -> list[list[int]]:
        """Token ids of every prompt (text prompts through the pool, all at once)."""
        texts = [p for p in prompts if isinstance(p, str)]
        results = await asyncio.gather(*(self.pool.encode(t) for t in texts), return_exceptions=True)
        for result in results:
            if isinstance(result, ValueError):
                raise bad_request(str(result), param="prompt")
            if isinstance(result, TokenizerPoolError):
                raise internal_error(str(result))
            if isinstance(result, BaseException):
                raise result
        encoded = iter(results)
        return [next(encoded) if isinstance(p, str) else p for p in prompts]  # type: ignore[misc]

    async def _prompt_text(self, sub: _Sub) -> str:
        if isinstance(sub.prompt, str):
            return sub.prompt
        try:
            return await self.pool.decode(sub.prompt_ids)
        except TokenizerPoolError as exc:
            raise internal_error(str(exc)) from None

    def _submit(self, subs: list[_Sub], params: SamplingParams) -> None:
        """Check every sub against the engine, then queue them all with no ``await`` in between (the
        caller's admission reservation is handed over to the engine's own count in the same step)."""
        for sub in subs:
            try:
                self.engine.engine.check_request(sub.prompt_ids, params)
            except ValueError as exc:
                raise _engine_refusal(exc) from None
        try:
            for sub in subs:
                sub.stream = self.engine.submit(sub.request_id, sub.prompt_ids, params)
        except EngineDeadError:
            _close(subs)
            raise service_unavailable("the engine is not running; the request was not accepted") from None

    async def _admitted(self, subs: list[_Sub]) -> None:
        """Wait until the engine has taken every sub; on any refusal, abort them all and answer it."""
        try:
            for sub in subs:
                assert sub.stream is not None
                await sub.stream.admitted()
        except BaseException as exc:
            _close(subs)
            raise _as_openai_error(exc) from None

    async def _final(self, sub: _Sub, params: SamplingParams) -> RequestOutput:
        final = None
        async for output in self._stream(sub, params):
            final = output
        assert final is not None and final.finished
        return final

    async def _stream(self, sub: _Sub, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        assert sub.stream is not None, "submit before streaming"
        finished = False
        try:
            async for output in sub.stream:
                if self.metrics is not None:
                    self.metrics.record_output(output, time.monotonic(), params.output_kind)
                finished = output.finished
                if output.error is not None:
                    raise internal_error(output.error)
                yield output
        except (ValueError, RequestFailedError, EngineDeadError) as exc:
            raise _as_openai_error(exc) from None
        finally:
            sub.stream.close()  # aborts now, not when the generator is collected, if we stopped early
            if not finished and self.metrics is not None:
                self.metrics.record_abort(sub.request_id)


def _engine_refusal(exc: ValueError) -> OpenAIError:
    """400 for a request the engine cannot serve; its message starts with the field, or is about the prompt."""
    error = sampling_error(exc)
    if error.param is None and "prompt" in error.message:
        error.param = "prompt"
    return error


def _close(subs: list[_Sub]) -> None:
    for sub in subs:
        if sub.stream is not None:
            sub.stream.close()


def _as_openai_error(exc: BaseException) -> BaseException:
    """The client-facing error for an engine-side failure; the details stay in the server log."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return _engine_refusal(exc)
    if isinstance(exc, RequestFailedError):
        return internal_error(str(exc))
    if isinstance(exc, EngineDeadError):
        return service_unavailable("the engine stopped; the request was aborted")
    return exc  # a cancellation, or a bug for the catch-all handler
