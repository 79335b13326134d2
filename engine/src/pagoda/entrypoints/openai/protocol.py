"""Request models of the OpenAI-compatible API (pydantic v2) and their mapping to ``SamplingParams``.

Field names and defaults follow the OpenAI API and vLLM's extensions. Unknown fields are ignored because
OpenAI clients send fields this server does not use. Types are strict, as OpenAI's are: ``echo: 0``,
``max_tokens: 5.0`` or ``tokens: [false]`` are errors, not coerced. Every bound ``SamplingParams`` enforces is
also a schema constraint here, so the served OpenAPI document states what the server accepts. Every invalid
value fails validation with the field in the error location, which ``errors.install_error_handlers`` turns
into a 400 naming that field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from pagoda.entrypoints.openai.errors import OpenAIError, sampling_error
from pagoda.entrypoints.openai.protocol_schemas import (
    LOGIT_BIAS_SCHEMA,
    RESPONSE_FORMAT_SCHEMA,
    STRUCTURED_OUTPUTS_SCHEMA,
    SUPPORTED_RESPONSE_FORMATS,
    TOOL_CHOICE_SCHEMA,
    TOOL_SCHEMA,
    nullable,
)
from pagoda.entrypoints.openai.protocol_types import (
    Int,
    Prompt,
    PromptInput,
    TokenId,
    check_prompt,
    check_stop,
)
from pagoda.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
    RequestOutputKind,
    SamplingParams,
)
from pagoda.structured_output.params import StructuredOutputsParams

# vLLM's default --max-logprobs: the bound the OpenAPI document states; requests are checked against the server's
# --max-logprobs (serving_base.RequestOptions).
MAX_LOGPROBS = 20
LOGPROBS_SCHEMA = {"maximum": MAX_LOGPROBS}
# Request fields whose default comes from the model's generation config when the request leaves them unset.
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Request fields that SamplingParams takes as they are, under the same name.
PASSED_FIELDS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "allowed_token_ids",
    "bad_words",
)
# SamplingParams fields whose errors errors.sampling_error does not name on its own.
_EXTRA_PARAM_NAMES = ("allowed_token_ids", "bad_words")
# Arguments the server itself passes to the chat template.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize"}
    # the rest of transformers' apply_chat_template arguments (return_dict=True would hand back a dict, not text)
    | {"conversation", "padding", "truncation", "max_length", "return_tensors", "return_dict"}
    | {"return_assistant_tokens_mask", "tokenizer_kwargs"}
    # what transformers itself hands every template: the special tokens (a client's eos_token would change how
    # the server's template ends each turn) and its helper functions
    | {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}
    | {"additional_special_tokens", "raise_exception", "strftime_now"}
)


# Strict types (no "1" for 1, no 0 for false), unknown fields ignored.
_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    """``stream_options``: whether a streamed response ends with a usage chunk."""

    model_config = _REQUEST_CONFIG

    include_usage: bool = False


class ChatMessage(BaseModel):
    """One chat message: a role and its content (a string, or text parts); other fields (``name``,
    ``tool_calls``, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: Union[None, str, list[dict[str, Any]]] = None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: only the fields the client sent."""
    return [m.model_dump(exclude_unset=True) for m in messages]


class _SamplingRequest(BaseModel):
    """The sampling fields completions and chat share, with vLLM's extensions."""

    model_config = _REQUEST_CONFIG

    model: Optional[str] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[Int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    n: Int = Field(default=1, ge=1)
    seed: Optional[Int] = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    logit_bias: Annotated[
        Optional[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]],
        WithJsonSchema(nullable(LOGIT_BIAS_SCHEMA)),
    ] = None
    ignore_eos: bool = False
    min_tokens: Int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Structured outputs: at most one of these (structured_request.py turns them into StructuredOutputsParams).
    response_format: Annotated[Optional[dict[str, Any]], WithJsonSchema(nullable(RESPONSE_FORMAT_SCHEMA))] = None
    structured_outputs: Annotated[Optional[dict[str, Any]], WithJsonSchema(nullable(STRUCTURED_OUTPUTS_SCHEMA))] = None
    guided_json: Union[None, str, dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[Annotated[list[str], Field(min_length=1)]] = None
    guided_grammar: Optional[str] = None
    # vLLM's prompt_embeds are torch.save bytes in base64, which vLLM read with torch.load (a 2025 advisory: a
    # crafted sparse tensor corrupts memory). This server takes text and token ids only: the field is refused, never
    # decoded, and kept out of the OpenAPI document.
    prompt_embeds: SkipJsonSchema[Any] = None
    # vLLM's extensions: scheduling priority (lower runs first under --scheduling-policy priority), the prompt's
    # own logprobs, tokens named by id in logprobs, and two sampling masks (only these tokens; never these words).
    priority: Int = Field(default=0, ge=MIN_SEED, le=MAX_SEED)
    prompt_logprobs: Optional[Int] = Field(default=None, ge=0, json_schema_extra=LOGPROBS_SCHEMA)
    return_tokens_as_token_ids: Optional[bool] = None
    allowed_token_ids: Optional[Annotated[list[TokenId], Field(min_length=1)]] = None
    bad_words: Optional[list[str]] = None
    # The top-level fields the request had that this model does not know (serving logs or refuses them).
    _unknown_fields: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _record_unknown_fields(cls, data: Any, handler: Any) -> Any:
        request = handler(data)
        if isinstance(data, dict):
            request._unknown_fields = tuple(sorted(str(k) for k in data if k not in cls.model_fields))
        return request

    @property
    def unknown_fields(self) -> tuple[str, ...]:
        """The request's top-level fields that no field of this model takes (ignored unless the server is strict)."""
        return self._unknown_fields

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        if value is not None and info.data.get("stream", False):
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value

    @field_validator("prompt_embeds", mode="before")
    @classmethod
    def _no_prompt_embeds(cls, value: object) -> None:
        if value is not None:
            raise ValueError("prompt_embeds is not supported: send the prompt as text or token ids")
        return None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: object) -> Union[None, str, list[str]]:
        # Checked by hand: pydantic's union errors would name "stop.str" / "stop.list[str]".
        return check_stop(value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Optional[StreamOptions], info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options can only be set when stream is true")
        return value

    @field_validator("response_format")
    @classmethod
    def _supported_response_format(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if value is not None and value.get("type") not in SUPPORTED_RESPONSE_FORMATS:
            raise ValueError(
                f"response_format type {value.get('type')!r} is not supported; supported types are "
                + ", ".join(repr(t) for t in SUPPORTED_RESPONSE_FORMATS)
            )
        return value

    def to_sampling_params(
        self,
        default_max_tokens: Optional[int],
        defaults: Mapping[str, Any],
        structured_outputs: Optional[StructuredOutputsParams] = None,
    ) -> SamplingParams:
        """The request's SamplingParams (raises ``OpenAIError`` 400 naming the field for invalid values).

        ``default_max_tokens`` is the output limit when the request sets none (None: up to the context length);
        ``defaults`` are the model's generation-config values for the fields the request leaves unset.
        """
        max_tokens, logprobs, extra = self._output_fields(default_max_tokens)
        generation = {}
        for name in GENERATION_DEFAULT_FIELDS:
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:  # else SamplingParams' own default (temperature 1.0, as vLLM)
                generation[name] = value
        passed = {name: getattr(self, name) for name in PASSED_FIELDS}
        try:
            return SamplingParams(
                **passed,
                **generation,
                max_tokens=max_tokens,
                logprobs=logprobs,
                logit_bias=dict(self.logit_bias) if self.logit_bias else None,
                output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
                structured_outputs=structured_outputs,
                **extra,
            )
        except ValueError as exc:
            raise extended_sampling_error(exc) from None

    def _output_fields(self, default_max_tokens: Optional[int]) -> tuple[Optional[int], Optional[int], dict[str, Any]]:
        """(max_tokens, logprobs, other SamplingParams arguments) from the endpoint's own fields."""
        raise NotImplementedError


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: PromptInput
    # 0 with echo: the prompt and its logprobs only (OpenAI's way of scoring a text); without echo, a 400 as vLLM's.
    max_tokens: Optional[Int] = Field(default=16, ge=0)
    logprobs: Optional[Int] = Field(default=None, ge=0, json_schema_extra=LOGPROBS_SCHEMA)
    echo: bool = False
    suffix: Annotated[Optional[str], WithJsonSchema({"type": "null", "description": "not supported"})] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: object) -> PromptInput:
        return check_prompt(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            raise ValueError("suffix is not supported")
        return value

    def prompts(self) -> list[Prompt]:
        """The prompts as a list: each one a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return [p if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[union-attr]

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the engine runs one step (max_tokens 1) whose token is dropped."""
        return self.echo and self.max_tokens == 0

    def _output_fields(self, default_max_tokens: Optional[int]) -> tuple[Optional[int], Optional[int], dict[str, Any]]:
        """``max_tokens`` null means ``default_max_tokens``; with ``echo`` and ``logprobs`` the prompt's logprobs
        are requested too (``prompt_logprobs`` when set, as vLLM)."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if max_tokens == 0:
            if not self.echo:
                raise sampling_error(ValueError("max_tokens must be at least 1 unless echo is true, got 0."))
            max_tokens = 1
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return max_tokens, self.logprobs, {"prompt_logprobs": prompt_logprobs}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[Int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[Int] = Field(default=None, ge=0, json_schema_extra=LOGPROBS_SCHEMA)
    tools: Annotated[
        Optional[list[dict[str, Any]]], WithJsonSchema(nullable({"type": "array", "items": TOOL_SCHEMA}))
    ] = None
    tool_choice: Annotated[Union[None, str, dict[str, Any]], WithJsonSchema(nullable(TOOL_CHOICE_SCHEMA))] = None
    parallel_tool_calls: bool = True
    # vLLM extensions: what reaches the chat template.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generate(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message requires add_generation_prompt to be false")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        reserved = sorted(set(value or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(
                f"chat_template_kwargs may not set {reserved}: the server sets those itself (use the request's own fields)"
            )
        return value

    def _output_fields(self, default_max_tokens: Optional[int]) -> tuple[Optional[int], Optional[int], dict[str, Any]]:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``; with neither, ``default_max_tokens``."""
        max_tokens = next(
            (v for v in (self.max_completion_tokens, self.max_tokens, default_max_tokens) if v is not None), None
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return max_tokens, logprobs, {"prompt_logprobs": self.prompt_logprobs}


def extended_sampling_error(exc: ValueError) -> OpenAIError:
    """``errors.sampling_error``, naming also the vLLM extras' fields."""
    error = sampling_error(exc)
    if error.param is None:
        error.param = next((name for name in _EXTRA_PARAM_NAMES if str(exc).startswith(name)), None)
    return error


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` or ``messages`` (rendered through the chat template)."""

    model_config = _REQUEST_CONFIG

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1, validate_default=True)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _exactly_one_input(cls, value: Optional[list[ChatMessage]], info: ValidationInfo) -> Any:
        if "prompt" not in info.data:
            return value  # prompt itself was invalid; that error is the one to report
        if (info.data["prompt"] is None) == (value is None):
            raise ValueError("give exactly one of prompt or messages")
        return value


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = _REQUEST_CONFIG

    model: Optional[str] = None
    tokens: list[TokenId]
