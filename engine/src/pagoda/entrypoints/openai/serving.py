"""The OpenAI completion, chat and tokenizer endpoints on top of AsyncLLMEngine (JSON and Server-Sent Events).

Every request goes through the same stages, all finished before a response (streamed or not) starts, so
a streamed request gets the same 4xx as a plain one:

1. limits (:mod:`limits`): list lengths, characters, ``n`` - microseconds, before any real work;
2. admission: its prompts x n sequences are reserved against ``--max-num-queued-requests`` (429 if full);
3. a structured-output constraint is compiled (a 400 if it cannot be), tokenizing or chat-template
   rendering on the tokenizer pool (never the event loop or engine thread);
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
from pagoda.engine.lora_requests import UnknownLoRAError
from pagoda.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    internal_error,
    sampling_error,
    service_unavailable,
    too_many_requests,
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
    completion_logprobs,
    merge_streams,
    sse_response,
    until_disconnected,
    usage,
)
from pagoda.entrypoints.openai.serving_chat import ChatOptions, ChatServing
from pagoda.entrypoints.openai.structured_request import compile_error, spec_chars, structured_outputs_of
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool, TokenizerPoolError
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.compiler import CompileQueueFull
from pagoda.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]


@dataclass(slots=True)
class Sub:
    """One engine request behind an HTTP request (a completions call with k prompts has k)."""

    request_id: str
    prompt: Prompt
    prompt_ids: list[int]
    index_base: int  # choice index = index_base + completion index
    stream: Optional[RequestStream] = None  # set by OpenAIServing.submit
    model: str = ""  # the name responses carry: the base model's, or the adapter's
    lora_name: Optional[str] = None  # the adapter the request runs with; None: the base model


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
        chat_options: Optional[ChatOptions] = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.pool = pool
        self.checker = checker
        self.admission = admission
        self.metrics = metrics
        self._engine_ids = itertools.count()
        self.chat_serving = ChatServing(self, chat_options or ChatOptions())

    # ---- completions ---------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        request_id = request_id_of(raw.scope)
        spec, spec_field = structured_outputs_of(body)
        params = self.sampling_params(body, spec)
        prompts = body.prompts()
        self.checker.check_prompts(prompts)
        self.check_sampling(body, params)
        with self.admission.reserve(len(prompts) * params.n):
            await self.compile_structured_output(spec, spec_field)
            prompt_ids = await self._tokenize(prompts)
            model, lora_name = self.model_of(body.model)
            subs = [
                Sub(self.engine_id("cmpl", request_id), p, ids, i * params.n, model=model, lora_name=lora_name)
                for i, (p, ids) in enumerate(zip(prompts, prompt_ids))
            ]
            self.submit(subs, params)
        await self.admitted(subs)
        response_id, created = f"cmpl-{request_id}", int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._completion_chunks(subs, params, response_id, created, include_usage, body.echo)
            return sse_response(chunks, request_id)
        finals = await until_disconnected(raw, request_id, asyncio.gather(*(self.final(s, params) for s in subs)))
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
                "model": subs[0].model,
                "choices": sorted(choices, key=lambda c: c["index"]),
                "usage": usage(finals),
            }
        )

    async def _completion_chunks(
        self, subs: list[Sub], params: SamplingParams, response_id: str, created: int, include_usage: bool, echo: bool
    ) -> AsyncIterator[dict]:
        model = subs[0].model

        def chunk(index: int, text: str, c: Optional[CompletionOutput]) -> dict:
            return {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": model,
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
        async for sub, output in merge_streams((s, self.stream(s, params)) for s in subs):
            stream_usage.add(output)
            for c in output.outputs:
                yield chunk(sub.index_base + c.index, c.text, c)
        if include_usage:
            yield {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": stream_usage.body(),
            }

    # ---- chat ----------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        return await self.chat_serving.chat(body, raw)

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

    def sampling_params(
        self, body: Union[CompletionRequest, ChatCompletionRequest], spec: Optional[StructuredOutputsParams] = None
    ) -> SamplingParams:
        defaults = self.engine.engine.model_config.generation_defaults
        if self.engine.engine.args.generation_config == "vllm":
            defaults = {}
        # raises OpenAIError (400 naming the field) for values SamplingParams rejects
        return body.to_sampling_params(None, defaults, structured_outputs=spec)

    async def compile_structured_output(self, spec: Optional[StructuredOutputsParams], field: Optional[str]) -> None:
        """Compile a request's constraint before it is submitted, so that one the engine cannot compile is a
        400 naming ``field`` (streamed or not) and the engine finds it compiled. The compile thread is shared
        and cannot be interrupted: a request whose compile takes longer than the limit gets a 400, and the
        grammar is still cached when it finishes."""
        if spec is None:
            return
        self.checker.check_structured_output(spec_chars(spec), field)
        limits, engine = self.checker.limits, self.engine.engine
        future = None
        try:
            # First use imports xgrammar (seconds): never on the event loop.
            future = await asyncio.to_thread(engine.compile_structured_output, spec, limits.max_pending_compiles)
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), limits.structured_output_compile_timeout
            )
        except ValueError as exc:
            raise compile_error(exc, field) from None
        except CompileQueueFull:
            raise too_many_requests(1) from None
        except TimeoutError:
            engine.structured_output_compiler().forget(spec)  # still queued: never compile it
            raise bad_request(
                f"{field}: compiling this constraint took longer than {limits.structured_output_compile_timeout:g} s;"
                " simplify it",
                field,
            ) from None
        except asyncio.CancelledError:
            if (
                future is not None and future.cancelled()
            ):  # another request with this spec timed out and dropped the queued compile
                raise too_many_requests(1) from None
            raise

    def check_sampling(self, body: Union[CompletionRequest, ChatCompletionRequest], params: SamplingParams) -> None:
        self.checker.check_sampling(params.n, body.stop, body.stop_token_ids, body.logit_bias)

    def new_sub(self, kind: str, request_id: str, prompt_ids: list[int], model: Optional[str]) -> Sub:
        """The one engine request of a chat completion (``model``: the request's model field)."""
        name, lora_name = self.model_of(model)
        return Sub(self.engine_id(kind, request_id), prompt_ids, prompt_ids, 0, model=name, lora_name=lora_name)

    def model_of(self, model: Optional[str]) -> tuple[str, Optional[str]]:
        """(the name responses carry, the adapter to run with) for a request's model field, which the route has
        checked: the base model's name (or none) runs the base model, any other name is a loaded adapter."""
        if model is None or model == self.model_name:
            return self.model_name, None
        return model, model

    def engine_id(self, kind: str, request_id: str) -> str:
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

    async def _prompt_text(self, sub: Sub) -> str:
        if isinstance(sub.prompt, str):
            return sub.prompt
        try:
            return await self.pool.decode(sub.prompt_ids)
        except TokenizerPoolError as exc:
            raise internal_error(str(exc)) from None

    def submit(self, subs: list[Sub], params: SamplingParams) -> None:
        """Check every sub against the engine, then queue them all with no ``await`` in between (the
        caller's admission reservation is handed over to the engine's own count in the same step)."""
        for sub in subs:
            try:
                self.engine.engine.check_request(sub.prompt_ids, params)
            except ValueError as exc:
                raise _engine_refusal(exc) from None
        try:
            for sub in subs:
                sub.stream = self.engine.submit(sub.request_id, sub.prompt_ids, params, sub.lora_name)
        except EngineDeadError:
            _close(subs)
            raise service_unavailable("the engine is not running; the request was not accepted") from None

    async def admitted(self, subs: list[Sub]) -> None:
        """Wait until the engine has taken every sub; on any refusal, abort them all and answer it."""
        try:
            for sub in subs:
                assert sub.stream is not None
                await sub.stream.admitted()
        except BaseException as exc:
            _close(subs)
            raise _as_openai_error(exc) from None

    async def final(self, sub: Sub, params: SamplingParams) -> RequestOutput:
        final = None
        async for output in self.stream(sub, params):
            final = output
        assert final is not None and final.finished
        return final

    async def stream(self, sub: Sub, params: SamplingParams) -> AsyncIterator[RequestOutput]:
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


def _close(subs: list[Sub]) -> None:
    for sub in subs:
        if sub.stream is not None:
            sub.stream.close()


def _as_openai_error(exc: BaseException) -> BaseException:
    """The client-facing error for an engine-side failure; the details stay in the server log."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, UnknownLoRAError):  # unloaded between the route's check and the engine taking it
        return OpenAIError(404, f"{exc}; it was unloaded", param="model", code="model_not_found")
    if isinstance(exc, ValueError):
        return _engine_refusal(exc)
    if isinstance(exc, RequestFailedError):
        return internal_error(str(exc))
    if isinstance(exc, EngineDeadError):
        return service_unavailable("the engine stopped; the request was aborted")
    return exc  # a cancellation, or a bug for the catch-all handler
