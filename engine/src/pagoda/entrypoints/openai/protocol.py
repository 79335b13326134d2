"""Request models of the OpenAI-compatible API (pydantic v2) and their mapping to ``SamplingParams``.

Field names and defaults follow the OpenAI API and vLLM's extensions. Unknown fields are ignored because
OpenAI clients send fields this server does not use. Every invalid value fails validation with the field in
the error location, which ``errors.install_error_handlers`` turns into a 400 naming that field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from pagoda.entrypoints.openai.errors import sampling_error
from pagoda.sampling_params import RequestOutputKind, SamplingParams

# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20
# Request fields whose default comes from the model's generation config when the request leaves them unset.
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SUPPORTED_RESPONSE_FORMATS = ("text", "json_object")

PromptInput = Union[str, list[str], list[int], list[list[int]]]
Prompt = Union[str, list[int]]


class StreamOptions(BaseModel):
    """``stream_options``: whether a streamed response ends with a usage chunk."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


def _is_token_ids(value: object) -> bool:
    # bool is an int subclass, but true/false in a prompt is a client bug, not token ids 1/0.
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _check_prompt(value: object) -> PromptInput:
    """One string, a list of strings, token ids, or a list of token-id lists; never empty lists."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("prompt must be a string, a non-empty list of strings, or (lists of) token ids")
    if all(isinstance(p, str) for p in value):
        return value
    if _is_token_ids(value):
        return value
    if all(isinstance(p, list) for p in value):
        if all(p and _is_token_ids(p) for p in value):
            return value
        raise ValueError("prompt token-id lists must be non-empty lists of non-negative integers")
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _check_stop(value: object) -> Union[None, str, list[str]]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("stop must be a string or a list of strings")


class _SamplingRequest(BaseModel):
    """The sampling fields completions and chat share, with vLLM's extensions."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = Field(default=1, ge=1)
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: object) -> Union[None, str, list[str]]:
        # Checked by hand: pydantic's union errors would name "stop.str" / "stop.list[str]".
        return _check_stop(value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Optional[StreamOptions], info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options can only be set when stream is true")
        return value

    def _sampling_params(
        self, max_tokens: Optional[int], logprobs: Optional[int], defaults: Mapping[str, Any], **extra: Any
    ) -> SamplingParams:
        """SamplingParams from the shared fields; a ValueError from it becomes a 400 naming the field."""
        generation = {}
        for name in GENERATION_DEFAULT_FIELDS:
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:  # else SamplingParams' own default (temperature 1.0, as vLLM)
                generation[name] = value
        try:
            return SamplingParams(
                n=self.n,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                logit_bias=dict(self.logit_bias) if self.logit_bias else None,
                skip_special_tokens=self.skip_special_tokens,
                output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
                **generation,
                **extra,
            )
        except ValueError as exc:
            raise sampling_error(exc) from None


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: PromptInput
    max_tokens: Optional[int] = Field(default=16, ge=1)
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: object) -> PromptInput:
        return _check_prompt(value)

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

    def to_sampling_params(self, default_max_tokens: Optional[int], defaults: Mapping[str, Any]) -> SamplingParams:
        """The request's SamplingParams (raises ``OpenAIError`` 400 for invalid values).

        ``default_max_tokens`` is used when the request sets ``max_tokens`` to null (None: up to the
        context length); ``defaults`` are the model's generation-config values for the fields the
        request leaves unset. With ``echo`` and ``logprobs`` the prompt's logprobs are requested too.
        """
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(max_tokens, self.logprobs, defaults, prompt_logprobs=prompt_logprobs)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[None, str, dict[str, Any]] = None
    # vLLM extension: whether the chat template appends the assistant turn's opening.
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _messages_have_roles(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(value):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] must have a string 'role'")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("response_format")
    @classmethod
    def _supported_response_format(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        # json_object is accepted as OpenAI clients send it routinely; the output is not grammar-constrained.
        if value is not None and value.get("type") not in SUPPORTED_RESPONSE_FORMATS:
            raise ValueError(
                f"response_format type {value.get('type')!r} is not supported; supported types are 'text' and "
                "'json_object'"
            )
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: Optional[list[Any]]) -> Optional[list[Any]]:
        if value:
            raise ValueError("tools are not supported")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: Union[None, str, dict[str, Any]]) -> Union[None, str, dict[str, Any]]:
        if value is not None and value != "none":
            raise ValueError("tool_choice other than 'none' is not supported: tools are not supported")
        return value

    def to_sampling_params(self, default_max_tokens: Optional[int], defaults: Mapping[str, Any]) -> SamplingParams:
        """The request's SamplingParams (raises ``OpenAIError`` 400 for invalid values).

        ``max_completion_tokens`` wins over the deprecated ``max_tokens``; with neither,
        ``default_max_tokens`` (None: up to the context length). ``defaults`` as for completions.
        """
        max_tokens = next(
            (v for v in (self.max_completion_tokens, self.max_tokens, default_max_tokens) if v is not None), None
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults)


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` or ``messages`` (rendered through the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = Field(default=None, validate_default=True)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _exactly_one_input(cls, value: Optional[list[dict[str, Any]]], info: ValidationInfo) -> Any:
        if "prompt" not in info.data:
            return value  # prompt itself was invalid; that error is the one to report
        if (info.data["prompt"] is None) == (value is None):
            raise ValueError("give exactly one of prompt or messages")
        return value


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]
