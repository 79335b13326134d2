"""The stages every generating endpoint shares, on top of AsyncLLMEngine: sampling parameters, structured-output
compilation, submission, admission and the engine's output stream.

Every request goes through the same stages, all finished before a response (streamed or not) starts, so
a streamed request gets the same 4xx as a plain one:

1. limits (:mod:`limits`): list lengths, characters, ``n`` - microseconds, before any real work;
2. admission: its prompts x n sequences are reserved against ``--max-num-queued-requests`` (429 if full);
3. a structured-output constraint is compiled (a 400 if it cannot be), tokenizing or chat-template
   rendering on the tokenizer pool (never the event loop or engine thread);
4. the engine's own checks (context length, token ids), then submission and the engine's acknowledgement.

The endpoints themselves stand above this module: completions and the tokenizer endpoints in :mod:`serving`,
chat in :mod:`serving_chat`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Optional, Union

from pagoda.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError, RequestStream
from pagoda.engine.lora_requests import UnknownLoRAError
from pagoda.entrypoints.openai.completion_logprobs import TokenText
from pagoda.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    internal_error,
    service_unavailable,
    too_many_requests,
)
from pagoda.entrypoints.openai.limits import AdmissionControl, RequestChecker
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, extended_sampling_error
from pagoda.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagoda.entrypoints.openai.structured_request import compile_error, spec_chars
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool, TokenizerPoolError
from pagoda.entrypoints.openai.tool_choice import named_tool_schema, required_tool_calls_schema
from pagoda.entrypoints.openai.tool_parsers import ToolParser
from pagoda.entrypoints.openai.unknown_fields import UnknownFields
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.compiler import CompileQueueFull
from pagoda.structured_output.params import StructuredOutputsParams

Prompt = Union[str, list[int]]


@dataclass(slots=True)
class Sub:
    """One engine request behind an HTTP request (a completions call with k prompts has k)."""

    request_id: str
    prompt: Prompt
    prompt_ids: list[int]
    index_base: int  # choice index = index_base + completion index
    stream: Optional[RequestStream] = None  # set by ServingBase.submit
    model: str = ""  # the name responses carry: the base model's, or the adapter's
    lora_name: Optional[str] = None  # the adapter the request runs with; None: the base model
    priority: int = 0  # the request's scheduling priority (lower first, with --scheduling-policy priority)


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """The server's chat flags: ``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--reasoning-parser``."""

    enable_auto_tool_choice: bool = False
    tool_parser: Optional[ToolParser] = None
    reasoning_parser: Optional[ReasoningParser] = None

    def check_tool_choice(self, mode: str) -> None:
        """400 for tool_choice "auto" on a server that runs without a tool parser."""
        if mode == "auto" and (not self.enable_auto_tool_choice or self.tool_parser is None):
            raise bad_request(
                'tool_choice "auto" needs the server to run with --enable-auto-tool-choice and --tool-call-parser; '
                'use tool_choice "required", a named tool, or "none"',
                "tool_choice",
            )


def forced_tool_calls(
    mode: str,
    name: Optional[str],
    tools: Optional[list[dict[str, Any]]],
    parallel_tool_calls: bool,
    spec: Optional[StructuredOutputsParams],
    spec_field: Optional[str],
) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The request's output constraint and its field: for tool_choice "required" or a named tool, the grammar that
    forces the calls (a 400 if the request set another constraint too); otherwise ``spec`` as it is."""
    if mode not in ("required", "named"):
        return spec, spec_field
    if spec is not None:
        raise bad_request(f"tool_choice {mode!r} cannot be combined with {spec_field}", "tool_choice")
    assert tools is not None
    schema = required_tool_calls_schema(tools, parallel_tool_calls) if mode == "required" else None
    assert schema is not None or name is not None
    return StructuredOutputsParams(json=schema if schema is not None else named_tool_schema(tools, name)), "tools"


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """The server flags that shape requests and responses (each a ``ServerConfig`` field of the same name)."""

    return_tokens_as_token_ids: bool = False
    strict_request_fields: bool = False
    enable_force_include_usage: bool = False
    response_role: str = "assistant"

    @classmethod
    def from_config(cls, config: Any) -> RequestOptions:
        """The options of a ``ServerConfig``."""
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})


Request = Union[CompletionRequest, ChatCompletionRequest]


class ServingBase:
    """The shared stages: validated requests become engine requests, whose outputs are streamed back."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        pool: TokenizerPool,
        checker: RequestChecker,
        admission: AdmissionControl,
        metrics=None,
        chat_options: Optional[ChatOptions] = None,
        request_options: Optional[RequestOptions] = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.pool = pool
        self.checker = checker
        self.admission = admission
        self.metrics = metrics
        self.chat_options = chat_options or ChatOptions()
        self.request_options = request_options or RequestOptions()
        self.unknown_fields = UnknownFields(self.request_options.strict_request_fields)
        self._engine_ids = itertools.count()

    def sampling_params(
        self,
        body: Union[CompletionRequest, ChatCompletionRequest],
        spec: Optional[StructuredOutputsParams] = None,
        endpoint: Optional[str] = None,
    ) -> SamplingParams:
        """The request's SamplingParams, after its unknown fields and logprobs counts are checked (400s).
        ``endpoint`` names the endpoint in the unknown-field warning (default: completions or chat completions)."""
        if endpoint is None:
            endpoint = "chat completions" if isinstance(body, ChatCompletionRequest) else "completions"
        self.unknown_fields.check(body.unknown_fields, endpoint)
        self.check_logprobs(body)
        defaults = self.engine.engine.model_config.generation_defaults
        if self.engine.engine.args.generation_config == "vllm":
            defaults = {}
        # raises OpenAIError (400 naming the field) for values SamplingParams rejects
        return body.to_sampling_params(None, defaults, structured_outputs=spec)

    async def compile_structured_output(self, spec: Optional[StructuredOutputsParams], field: Optional[str]) -> None:
        """Compile a request's constraint before it is submitted, so that one the engine cannot compile is a
        400 naming ``field`` (streamed or not) and the engine finds it compiled. A request whose compile takes
        longer than the limit gets a 400 and its compile is abandoned (its worker is replaced; the failure is
        cached, so the same spec is refused at once); while ``--max-abandoned-compiles`` run on, new constraints
        get a 429."""
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
        except CompileQueueFull as exc:
            raise too_many_requests(1, str(exc)) from None
        except TimeoutError:
            engine.structured_output_compiler().forget(spec)  # never compile it (queued) or abandon it (running)
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

    def check_logprobs(self, body: Request) -> None:
        """400 for logprobs counts above ``--max-logprobs`` (chat's ``logprobs`` is a flag, not a count)."""
        limit = self.engine.engine.max_logprobs
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(body, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                raise bad_request(f"{name}={value} exceeds the server's maximum of {limit} (--max-logprobs)", name)

    def include_usage(self, body: Request) -> bool:
        """Whether a stream ends with a usage chunk: asked for, or forced by ``--enable-force-include-usage``."""
        asked = bool(body.stream_options and body.stream_options.include_usage)
        return asked or self.request_options.enable_force_include_usage

    def token_text(self, body: Request, params: SamplingParams) -> TokenText:
        """How the request's tokens read in logprobs (``return_tokens_as_token_ids``: the request's, else the
        server's)."""
        as_ids = body.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.request_options.return_tokens_as_token_ids
        return TokenText(
            self.engine.engine.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens, as_ids
        )

    def check_sampling(self, body: Union[CompletionRequest, ChatCompletionRequest], params: SamplingParams) -> None:
        self.checker.check_sampling(params.n, body.stop, body.stop_token_ids, body.logit_bias)

    def new_sub(
        self, kind: str, request_id: str, prompt_ids: list[int], model: Optional[str], priority: int = 0
    ) -> Sub:
        """The one engine request of a chat completion (``model``: the request's model field)."""
        name, lora_name = self.model_of(model)
        return Sub(
            self.engine_id(kind, request_id),
            prompt_ids,
            prompt_ids,
            0,
            model=name,
            lora_name=lora_name,
            priority=priority,
        )

    def model_of(self, model: Optional[str]) -> tuple[str, Optional[str]]:
        """(the name responses carry, the adapter to run with) for a request's model field, which the route has
        checked: the base model's name (or none) runs the base model, any other name is a loaded adapter."""
        if model is None or model == self.model_name:
            return self.model_name, None
        return model, model

    async def prompt_text(self, sub: Sub) -> str:
        """The text a choice of ``sub`` echoes: a text prompt as sent, a token-id prompt decoded."""
        if isinstance(sub.prompt, str):
            return sub.prompt
        try:
            return await self.pool.decode(sub.prompt_ids)
        except TokenizerPoolError as exc:
            raise internal_error(str(exc)) from None

    def engine_id(self, kind: str, request_id: str) -> str:
        # Unique even when clients reuse an X-Request-Id, and still found in the logs by it.
        return f"{kind}-{request_id}-{next(self._engine_ids)}"

    def submit(self, subs: list[Sub], params: SamplingParams) -> None:
        """Check every sub against the engine, then queue them all with no ``await`` in between (the
        caller's admission reservation is handed over to the engine's own count in the same step)."""
        for sub in subs:
            try:
                self.engine.engine.check_request(sub.prompt_ids, params, sub.priority)
            except ValueError as exc:
                raise _engine_refusal(exc) from None
        try:
            for sub in subs:
                sub.stream = self.engine.submit(
                    sub.request_id, sub.prompt_ids, params, sub.lora_name, priority=sub.priority
                )
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
                    fail = service_unavailable if output.error_unavailable else internal_error
                    raise fail(output.error)
                yield output
        except (ValueError, RequestFailedError, EngineDeadError) as exc:
            raise _as_openai_error(exc) from None
        finally:
            sub.stream.close()  # aborts now, not when the generator is collected, if we stopped early
            if not finished and self.metrics is not None:
                self.metrics.record_abort(sub.request_id)


def _engine_refusal(exc: ValueError) -> OpenAIError:
    """400 for a request the engine cannot serve; its message starts with the field, or is about the priority
    (vLLM's wording: "Got priority N but ...") or the prompt."""
    error = extended_sampling_error(exc)
    if error.param is None and error.message.startswith("Got priority"):
        error.param = "priority"
    elif error.param is None and "prompt" in error.message:
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
