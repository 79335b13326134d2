"""The OpenAI completion and tokenizer endpoints (JSON and Server-Sent Events), and the chat endpoint's entry.

The stages every request goes through are :mod:`serving_base`'s; chat is :mod:`serving_chat`'s.
"""

from __future__ import annotations

import asyncio
import time
from functools import cached_property
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.entrypoints.openai.completion_stream import CompletionShape, completion_choice, completion_chunks
from pagoda.entrypoints.openai.errors import bad_request, internal_error
from pagoda.entrypoints.openai.http_guards import request_id_of
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    message_dicts,
)
from pagoda.entrypoints.openai.responses import (
    CLIENT_CLOSED_REQUEST,
    sse_response,
    until_disconnected,
    usage,
)
from pagoda.entrypoints.openai.serving_base import Prompt, ServingBase, Sub
from pagoda.entrypoints.openai.serving_chat import ChatServing
from pagoda.entrypoints.openai.structured_request import structured_outputs_of
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool, TokenizerPoolError


class OpenAIServing(ServingBase):
    """Turns validated requests into engine requests and engine outputs into OpenAI responses."""

    @cached_property
    def chat_serving(self) -> ChatServing:
        """The chat endpoint, over these stages and the server's chat options."""
        return ChatServing(self, self.chat_options)

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
                Sub(
                    self.engine_id("cmpl", request_id),
                    p,
                    ids,
                    i * params.n,
                    model=model,
                    lora_name=lora_name,
                    priority=body.priority,
                )
                for i, (p, ids) in enumerate(zip(prompts, prompt_ids))
            ]
            self.submit(subs, params)
        await self.admitted(subs)
        response_id, created = f"cmpl-{request_id}", int(time.time())
        shape = CompletionShape(body.echo, body.echo_only, params.logprobs, self.token_text(body, params))
        if body.stream:
            chunks = completion_chunks(self, subs, params, shape, (response_id, created), self.include_usage(body))
            return sse_response(chunks, request_id)
        finals = await until_disconnected(raw, request_id, asyncio.gather(*(self.final(s, params) for s in subs)))
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = []
        for sub, output in zip(subs, finals):
            echo = (await self.prompt_text(sub)) if body.echo and params.logprobs is None else ""
            for c in output.outputs:
                choices.append(await completion_choice(shape, sub, output, c, echo))
        return JSONResponse(
            {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": subs[0].model,
                "choices": sorted(choices, key=lambda c: c["index"]),
                "usage": usage(finals, completion=not body.echo_only),
            }
        )

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
        return await detokenize_ids(self.pool, body.tokens, self.engine.engine.model_config.vocab_size)

    # ---- completion helpers ---------------------------------------------------------------

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


async def detokenize_ids(pool: TokenizerPool, tokens: list[int], vocab: int) -> dict[str, str]:
    """``POST /detokenize``'s answer: the text of ``tokens`` (a 400 naming ``tokens`` for ids outside the vocabulary)."""
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
    try:
        return {"prompt": await pool.decode(tokens)}
    except TokenizerPoolError as exc:
        raise internal_error(str(exc)) from None
