"""``POST /v1/responses`` (OpenAI's Responses API, as vLLM serves it), and the stored responses' routes.

A request goes through the shared stages of :mod:`serving_base` (limits, admission, structured-output compile,
submission) like a chat completion: its ``input`` items (after the conversation of ``previous_response_id``,
and ``instructions`` as the system message) are chat messages rendered by the model's chat template; tools,
``tool_choice`` and ``text.format`` resolve to the same constraints and parsers as chat's (``required`` and a
named function are forced by a grammar, ``auto`` reads the output with ``--tool-call-parser``, reasoning is
split by ``--reasoning-parser``). The output is shaped by :mod:`responses_stream`; with ``store`` (the
default) the response is kept in the :class:`~response_store.ResponseStore`, where it can be read, continued,
cancelled while it runs, and deleted.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagoda.entrypoints.openai.chat_output import ChatOutputConfig
from pagoda.entrypoints.openai.errors import OpenAIError, bad_request, internal_error
from pagoda.entrypoints.openai.http_guards import request_id_of
from pagoda.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    chat_tools,
    input_messages,
    text_format_spec,
    tool_choice_mode,
)
from pagoda.entrypoints.openai.response_store import ResponseStore, StoredResponse, until_cancelled
from pagoda.entrypoints.openai.responses import CLIENT_CLOSED_REQUEST, until_disconnected
from pagoda.entrypoints.openai.responses_stream import (
    ResponseEvents,
    new_id,
    output_items,
    response_usage,
    sse_events,
)
from pagoda.entrypoints.openai.serving_base import ChatOptions, ServingBase, Sub, forced_tool_calls
from pagoda.entrypoints.openai.structured_request import structured_outputs_of
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPoolError
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.params import StructuredOutputsParams
from pagoda.tokenizer import ChatRenderOptions


@dataclass(slots=True)
class _Run:
    """One response being generated: its request, engine request, object so far and store entry."""

    body: ResponsesRequest
    sub: Sub
    params: SamplingParams
    output: ChatOutputConfig
    head: dict[str, Any]  # the response object without status, output and usage
    conversation: list[dict[str, Any]]  # the input messages, without the instructions
    entry: Optional[StoredResponse]

    def response(self, status: str, output: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None, **more):
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            **self.head,
            "status": status,
            "output": output,
            "usage": usage,
            "incomplete_details": incomplete,
            **more,
        }


class ResponsesServing:
    """The Responses API over the shared stages of :class:`~serving_base.ServingBase` (``base``)."""

    def __init__(self, base: ServingBase, options: ChatOptions, store: ResponseStore) -> None:
        self.base = base
        self.options = options
        self.store = store

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        """``POST /v1/responses``: every 4xx before the response starts, streamed or not."""
        base = self.base
        request_id = request_id_of(raw.scope)
        history = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id, "previous_response_id")
            if not previous.done.is_set():
                message = f"previous_response_id: response {body.previous_response_id!r} is still in progress"
                raise bad_request(message, "previous_response_id")
            history = previous.conversation
        try:
            new_messages = input_messages(body.input)
        except ValueError as exc:
            raise bad_request(str(exc), "input") from None
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        messages = [*system, *history, *new_messages]
        base.checker.check_messages(messages)
        tools, output, spec, spec_field = self._plan(body)
        params = base.sampling_params(body, spec, "responses")  # type: ignore[arg-type]
        if output.tool_mode == "auto" and params.skip_special_tokens:
            params = replace(params, skip_special_tokens=False)  # parsers read markers tokenizers may mark special
        base.check_sampling(body, params)  # type: ignore[arg-type]
        with base.admission.reserve(1):
            await base.compile_structured_output(spec, spec_field)
            options = ChatRenderOptions(tools, False, body.chat_template_kwargs)
            try:
                prompt_ids = await base.pool.render_chat(messages, True, options)
            except ValueError as exc:
                raise bad_request(str(exc), param="input") from None
            except TokenizerPoolError as exc:
                raise internal_error(str(exc)) from None
            sub = base.new_sub("resp", request_id, prompt_ids, body.model, body.priority)
            base.submit([sub], params)
        await base.admitted([sub])
        run = _Run(body, sub, params, output, self._head(body, sub, params), [*history, *new_messages], None)
        if body.store:
            run.entry = self.store.begin(run.response("in_progress", []))
            run.entry.abort = sub.stream.close if sub.stream is not None else None
        if body.stream:
            return sse_events(self._events(run))
        result = await until_disconnected(raw, request_id, self._whole(run))
        if result is None:
            self._finish(run, run.response("cancelled", []), None)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(result)

    def _plan(
        self, body: ResponsesRequest
    ) -> tuple[Optional[list[dict]], ChatOutputConfig, Optional[StructuredOutputsParams], Optional[str]]:
        """(tools for the template, how the output is read, the output constraint and its field)."""
        tools = None
        if body.tools:
            self.base.checker.check_tools(body.tools)
            tools = chat_tools(body.tools)
        mode, name = tool_choice_mode(body.tool_choice, tools)
        self.options.check_tool_choice(mode)
        parser = self.options.tool_parser
        spec, spec_field = structured_outputs_of(body)
        formatted = text_format_spec(body.text)
        if formatted is not None:
            if spec is not None:
                raise bad_request(f"give at most one of text.format and {spec_field}", "text.format")
            spec, spec_field = formatted, "text.format.schema" if formatted.json is not None else "text.format"
        spec, spec_field = forced_tool_calls(mode, name, tools, body.parallel_tool_calls, spec, spec_field)
        reasoning = self.options.reasoning_parser
        if (body.chat_template_kwargs or {}).get("enable_thinking") is False:
            reasoning = None  # thinking is off: the output is content, streamed as it comes (not held back)
        output = ChatOutputConfig(mode, name, parser, reasoning, constrained=spec is not None)
        return (tools if mode != "none" else None), output, spec, spec_field

    def _head(self, body: ResponsesRequest, sub: Sub, params: SamplingParams) -> dict[str, Any]:
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": new_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "model": sub.model,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "tools": list(body.tools or []),
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": {"format": fmt},
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "background": False,
            "truncation": body.truncation or "disabled",
            "metadata": body.metadata,
            "user": body.user,
            "reasoning": body.reasoning,
            "error": None,
        }

    def _finish(self, run: _Run, response: dict[str, Any], message: Optional[dict[str, Any]]) -> None:
        if run.entry is not None:
            conversation = [*run.conversation, message] if message is not None else run.conversation
            self.store.finish(run.entry, response, conversation)

    async def _whole(self, run: _Run) -> dict[str, Any]:
        """The whole response of a request without ``stream``."""
        final: Optional[RequestOutput] = None
        cancelled = run.entry.cancelled if run.entry is not None else None
        outputs = self.base.stream(run.sub, run.params)
        async for output in until_cancelled(outputs, cancelled) if cancelled is not None else outputs:
            final = output
        if final is None:  # cancelled (POST /v1/responses/{id}/cancel, or DELETE) before it ended
            response = run.response("cancelled", [])
            self._finish(run, response, None)
            return response
        (c,) = final.outputs
        message = run.output.message(c.text)
        status = "incomplete" if c.finish_reason == "length" else "completed"
        usage = response_usage(len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens)
        response = run.response(status, output_items(message, status), usage, completed_at=int(time.time()))
        self._finish(run, response, message)
        return response

    async def _events(self, run: _Run) -> AsyncIterator[dict[str, Any]]:
        """The events of a request with ``stream``: created, in_progress, the items', then completed (or
        incomplete, or failed)."""
        events = ResponseEvents()
        yield events.event("response.created", response=run.response("in_progress", []))
        yield events.event("response.in_progress", response=run.response("in_progress", []))
        streamer = run.output.streamer()
        prompt_tokens = cached = generated = 0
        finish_reason: Optional[str] = None
        outputs = self.base.stream(run.sub, run.params)
        if run.entry is not None:
            outputs = until_cancelled(outputs, run.entry.cancelled)
        try:
            async for output in outputs:
                prompt_tokens, cached = len(output.prompt_token_ids), output.num_cached_tokens
                for c in output.outputs:
                    generated += len(c.token_ids)
                    for event in events.delta(streamer.delta(c.text)):
                        yield event
                    if c.finished:
                        finish_reason = c.finish_reason
                        for event in events.delta(streamer.finish()):
                            yield event
        except OpenAIError as exc:
            yield events.event("error", code=str(exc.code), message=exc.message, param=exc.param)
            error = {"code": "server_error", "message": exc.message}
            response = run.response("failed", events.items, error=error)
            self._finish(run, response, None)
            yield events.event("response.failed", response=response)
            return
        except BaseException:  # the client went away: its request is aborted
            self._finish(run, run.response("cancelled", events.items), None)
            raise
        usage = response_usage(prompt_tokens, generated, cached)
        if finish_reason is None:  # cancelled while it ran
            for event in events.close("incomplete"):
                yield event
            response = run.response("cancelled", events.items, usage)
            self._finish(run, response, None)
            yield events.event("response.incomplete", response=response)
            return
        status = "incomplete" if finish_reason == "length" else "completed"
        for event in events.close(status):
            yield event
        response = run.response(status, events.items, usage, completed_at=int(time.time()))
        self._finish(run, response, events.message())
        yield events.event(f"response.{status}", response=response)

    # ---- stored responses -----------------------------------------------------------------------------

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).body

    async def cancel(self, response_id: str) -> dict[str, Any]:
        return await self.store.cancel(response_id)

    def delete(self, response_id: str) -> dict[str, Any]:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def add_responses_routes(
    app: FastAPI,
    route: Callable,
    admit: Callable[[Optional[str]], object],
    serving: Callable[[], Optional[ResponsesServing]],
) -> None:
    """The Responses API's routes: ``route(method, path)`` registers a documented one, ``admit(model)`` raises
    unless the server takes requests for ``model`` (503 while loading or draining, 404 for a model it does not
    serve)."""

    def of(model: Optional[str] = None) -> ResponsesServing:
        admit(model)
        responses = serving()
        if responses is None:  # admitted, so loaded: a pooling model (--task embed or score)
            raise bad_request("this server runs a pooling model (--task embed or score): it has no Responses API")
        return responses

    @route("post", "/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await of(body.model).create(body, raw)

    @route("post", "/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict:
        return await of().cancel(response_id)

    async def stored_response(response_id: str, raw: Request) -> dict:
        return of().delete(response_id) if raw.method == "DELETE" else of().retrieve(response_id)

    # One route answers both methods, so that a 405 for any other names both in Allow; the two after it (never
    # reached) document each method.
    path = "/v1/responses/{response_id}"
    app.add_api_route(path, stored_response, methods=["GET", "DELETE"], include_in_schema=False)
    for method in ("get", "delete"):
        route(method, path)(stored_response)
