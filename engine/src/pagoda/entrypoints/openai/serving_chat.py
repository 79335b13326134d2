"""``POST /v1/chat/completions``: tools, tool choice, structured outputs, reasoning, and the chat template.

The stages are the completions endpoint's (see :mod:`serving_base`); chat adds the tools (validated, handed to
the template), the tool choice (``required`` and a named tool are enforced by a grammar built from the tools'
schemas, ``auto`` reads the output with ``--tool-call-parser``), and the reasoning split
(``--reasoning-parser``). Outputs are shaped by :mod:`chat_output`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.entrypoints.openai.chat_output import ChatOutputConfig, ChatOutputStreamer
from pagoda.entrypoints.openai.completion_logprobs import prompt_logprobs_body
from pagoda.entrypoints.openai.errors import bad_request, internal_error
from pagoda.entrypoints.openai.http_guards import request_id_of
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, message_dicts
from pagoda.entrypoints.openai.responses import (
    CLIENT_CLOSED_REQUEST,
    StreamUsage,
    chat_logprobs,
    sse_response,
    until_disconnected,
    usage,
)
from pagoda.entrypoints.openai.serving_base import ChatOptions, ServingBase, Sub, forced_tool_calls
from pagoda.entrypoints.openai.structured_request import structured_outputs_of
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPoolError
from pagoda.entrypoints.openai.tool_choice import (
    resolve_tool_choice,
    validate_tools,
)
from pagoda.outputs import CompletionOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.params import StructuredOutputsParams
from pagoda.tokenizer import ChatRenderOptions


@dataclass(frozen=True, slots=True)
class _ChatPlan:
    """What a chat request's tool and format fields resolve to."""

    tools: Optional[list[dict[str, Any]]]  # for the template (None when tool_choice is none)
    output: ChatOutputConfig
    spec: Optional[StructuredOutputsParams]
    spec_field: Optional[str]


class ChatServing:
    """Chat completions over the shared stages of :class:`~serving_base.ServingBase` (``base``)."""

    def __init__(self, base: ServingBase, options: ChatOptions) -> None:
        self.base = base
        self.options = options

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        base = self.base
        request_id = request_id_of(raw.scope)
        messages = message_dicts(body.messages)
        base.checker.check_messages(messages)
        plan = self._plan(body)
        params = base.sampling_params(body, plan.spec)
        if plan.output.tool_mode == "auto" and params.skip_special_tokens:
            # Parsers read markers that tokenizers may mark special ([TOOL_CALLS], <tool_call>); stop tokens stay
            # out of the text either way.
            params = replace(params, skip_special_tokens=False)
        base.check_sampling(body, params)
        with base.admission.reserve(params.n):
            await base.compile_structured_output(plan.spec, plan.spec_field)
            options = ChatRenderOptions(plan.tools, body.continue_final_message, body.chat_template_kwargs)
            try:
                prompt_ids = await base.pool.render_chat(messages, body.add_generation_prompt, options)
            except ValueError as exc:
                raise bad_request(str(exc), param="messages") from None
            except TokenizerPoolError as exc:
                raise internal_error(str(exc)) from None
            sub = base.new_sub("chatcmpl", request_id, prompt_ids, body.model, priority=body.priority)
            base.submit([sub], params)
        await base.admitted([sub])
        response_id, created = f"chatcmpl-{request_id}", int(time.time())
        as_ids = base.token_text(body, params).as_token_ids
        if body.stream:
            include_usage = base.include_usage(body)
            chunks = self._chunks(sub, params, plan.output, response_id, created, include_usage, as_ids)
            return sse_response(chunks, request_id)
        output = await until_disconnected(raw, request_id, base.final(sub, params))
        if output is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = []
        for c in output.outputs:
            message = plan.output.message(c.text)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(c, params.logprobs, as_ids) if params.logprobs is not None else None,
                    "finish_reason": _finish_reason(c, bool(message.get("tool_calls")), plan.output.tool_mode),
                    "stop_reason": c.stop_reason,
                }
            )
        return JSONResponse(
            {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": sub.model,
                "choices": choices,
                "usage": usage([output]),
                "prompt_logprobs": prompt_logprobs_body(output.prompt_logprobs),
            }
        )

    def _plan(self, body: ChatCompletionRequest) -> _ChatPlan:
        """Validate tools and tool_choice, and pick the one output constraint (400 naming the field)."""
        if body.tools:
            self.base.checker.check_tools(body.tools)  # before any work per tool
        try:
            tools = validate_tools(body.tools) if body.tools else None
        except ValueError as exc:
            raise bad_request(str(exc), "tools") from None
        try:
            mode, name = resolve_tool_choice(body.tool_choice, tools)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice") from None
        self.options.check_tool_choice(mode)
        parser = self.options.tool_parser
        spec, spec_field = structured_outputs_of(body)
        spec, spec_field = forced_tool_calls(mode, name, tools, body.parallel_tool_calls, spec, spec_field)
        role = self.base.request_options.response_role if body.add_generation_prompt else body.messages[-1].role
        output = ChatOutputConfig(
            mode, name, parser, self.options.reasoning_parser, constrained=spec is not None, role=role
        )
        return _ChatPlan(tools if mode != "none" else None, output, spec, spec_field)

    async def _chunks(
        self,
        sub: Sub,
        params: SamplingParams,
        config: ChatOutputConfig,
        response_id: str,
        created: int,
        include_usage: bool,
        as_token_ids: bool = False,
    ) -> AsyncIterator[dict]:
        def chunk(choices: list[dict], **extra) -> dict:
            return {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": sub.model,
                "choices": choices,
                **extra,
            }

        yield chunk(
            [
                {"index": i, "delta": {"role": config.role, "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(params.n)
            ]
        )
        streamers: dict[int, ChatOutputStreamer] = {}
        stream_usage = StreamUsage()
        async for output in self.base.stream(sub, params):
            stream_usage.add(output)
            for c in output.outputs:
                streamer = streamers.setdefault(c.index, config.streamer())
                delta = streamer.delta(c.text)
                if c.finished:
                    delta = merge_deltas(delta, streamer.finish())
                if not delta and not c.finished and params.logprobs is None:
                    continue  # held back (a marker may be starting): nothing to say yet
                choice = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": chat_logprobs(c, params.logprobs, as_token_ids)
                    if params.logprobs is not None
                    else None,
                    "finish_reason": _finish_reason(c, streamer.called_tools, config.tool_mode) if c.finished else None,
                }
                yield chunk([choice])
        if include_usage:
            yield chunk([], usage=stream_usage.body())


def merge_deltas(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One delta saying what two consecutive ones say (text fields joined, tool-call fragments listed)."""
    merged = dict(first)
    for key, value in second.items():
        if key == "tool_calls":
            merged[key] = [*merged.get(key, []), *value]
        elif isinstance(value, str):
            merged[key] = merged.get(key, "") + value
        else:
            merged[key] = value
    return merged


def _finish_reason(c: CompletionOutput, called_tools: bool, mode: str) -> Optional[str]:
    """``tool_calls`` when the model chose to call tools (auto, required); a forced named call ends with ``stop``,
    as OpenAI's and vLLM's do."""
    return "tool_calls" if called_tools and c.finish_reason == "stop" and mode != "named" else c.finish_reason
