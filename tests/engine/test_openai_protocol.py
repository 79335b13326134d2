"""Request models of the OpenAI-compatible API: parsing, rejections that name the field, SamplingParams mapping."""

from typing import Any

import pytest
from pydantic import ValidationError

from pagoda.entrypoints.openai.errors import OpenAIError, sampling_error, validation_error
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagoda.sampling_params import RequestOutputKind, SamplingParams

MESSAGES = [{"role": "user", "content": "hi"}]


def rejection(model: type, payload: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI error body a payload gets: pydantic's errors mapped as the server maps them."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(payload)
    return validation_error(info.value.errors()).body()["error"]


# --- prompts -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("once upon", ["once upon"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ("", [""]),
    ],
)
def test_prompt_forms_normalise_to_a_list_of_prompts(prompt: Any, expected: list[Any]) -> None:
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize(
    "prompt", [[], [[]], [[1], []], [1, "a"], [1.5], [True, 2], [-1], [[1, -2]], {"text": "a"}, 7, None]
)
def test_malformed_prompts_are_rejected_naming_prompt(prompt: Any) -> None:
    error = rejection(CompletionRequest, {"prompt": prompt})
    assert error["param"] == "prompt"
    assert error["message"].startswith("prompt")


def test_missing_prompt_is_rejected() -> None:
    assert rejection(CompletionRequest, {"model": "m"})["param"] == "prompt"


def test_unknown_fields_are_ignored() -> None:
    request = CompletionRequest.model_validate({"prompt": "a", "best_of": 1, "metadata": {"x": 1}})
    assert request.prompts() == ["a"]


# --- unsupported features ------------------------------------------------------------------------------------


def test_suffix_is_rejected() -> None:
    error = rejection(CompletionRequest, {"prompt": "a", "suffix": "end"})
    assert (error["param"], error["message"]) == ("suffix", "suffix is not supported")
    assert CompletionRequest(prompt="a", suffix=None).suffix is None


def test_tools_and_tool_choice_are_accepted_by_the_schema() -> None:
    # Their meaning (tool names, JSON Schemas, the server's parsers) is checked when the request is served.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False}
    )
    assert (request.tools, request.tool_choice, request.parallel_tool_calls) == (tools, "required", False)


def test_no_tools_is_accepted() -> None:
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": None, "tool_choice": "none"})
    assert request.tool_choice == "none"


@pytest.mark.parametrize("kind", ["text", "json_object", "json_schema"])
def test_openai_response_formats_are_accepted(kind: str) -> None:
    request = ChatCompletionRequest(messages=MESSAGES, response_format={"type": kind})
    assert request.response_format == {"type": kind}


@pytest.mark.parametrize("response_format", [{"type": "xml"}, {}])
def test_other_response_formats_are_rejected(response_format: dict[str, Any]) -> None:
    error = rejection(ChatCompletionRequest, {"messages": MESSAGES, "response_format": response_format})
    assert error["param"] == "response_format"
    assert "not supported" in error["message"]


def test_continue_final_message_needs_add_generation_prompt_off() -> None:
    error = rejection(ChatCompletionRequest, {"messages": MESSAGES, "continue_final_message": True})
    assert error["param"] == "continue_final_message"
    request = ChatCompletionRequest(messages=MESSAGES, continue_final_message=True, add_generation_prompt=False)
    assert request.continue_final_message


def test_chat_template_kwargs_cannot_override_the_servers_own_arguments() -> None:
    error = rejection(ChatCompletionRequest, {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}})
    assert error["param"] == "chat_template_kwargs"
    request = ChatCompletionRequest(messages=MESSAGES, chat_template_kwargs={"enable_thinking": False})
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_top_logprobs_requires_logprobs() -> None:
    error = rejection(ChatCompletionRequest, {"messages": MESSAGES, "top_logprobs": 3})
    assert error["param"] == "top_logprobs"
    assert "logprobs" in error["message"]


@pytest.mark.parametrize(
    ("model", "payload", "param"),
    [
        (CompletionRequest, {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
        (CompletionRequest, {"prompt": "a", "logprobs": -1}, "logprobs"),
        (CompletionRequest, {"prompt": "a", "max_tokens": -1}, "max_tokens"),
        (CompletionRequest, {"prompt": "a", "n": 0}, "n"),
        (CompletionRequest, {"prompt": "a", "stop": 5}, "stop"),
        (CompletionRequest, {"prompt": "a", "stop": ["x", 1]}, "stop"),
        (CompletionRequest, {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        (ChatCompletionRequest, {"messages": []}, "messages"),
        (ChatCompletionRequest, {"messages": [{"content": "no role"}]}, "messages.0.role"),
        (ChatCompletionRequest, {"messages": [{"role": 1, "content": "x"}]}, "messages.0.role"),
        (ChatCompletionRequest, {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (ChatCompletionRequest, {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
        (TokenizeRequest, {}, "messages"),
        (TokenizeRequest, {"prompt": "a", "messages": MESSAGES}, "messages"),
        (DetokenizeRequest, {"tokens": ["a"]}, "tokens.0"),
    ],
)
def test_invalid_values_name_their_field(model: type, payload: dict[str, Any], param: str) -> None:
    assert rejection(model, payload)["param"] == param


def test_tokenize_takes_a_prompt_or_messages() -> None:
    assert TokenizeRequest(prompt="a").messages is None
    assert TokenizeRequest(messages=MESSAGES).add_generation_prompt is True
    assert DetokenizeRequest(tokens=[1, 2]).tokens == [1, 2]


# --- SamplingParams mapping ----------------------------------------------------------------------------------


def test_completion_maps_every_sampling_field() -> None:
    # Each of these has the same name and value in the request and in SamplingParams.
    same = {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "n": 2,
        "logprobs": 3,
        "stop": ["x"],
        "stop_token_ids": [4],
        "seed": 11,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "ignore_eos": True,
        "min_tokens": 2,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    request = CompletionRequest.model_validate({"prompt": "a", **same, "logit_bias": {"7": 2.0}})
    params = request.to_sampling_params(None, {"temperature": 0.1, "top_k": 50})
    expected = SamplingParams(**same, logit_bias={7: 2.0}, output_kind=RequestOutputKind.FINAL_ONLY)
    assert params == expected


def test_generation_config_defaults_fill_only_unset_fields() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    params = CompletionRequest(prompt="a", top_k=3).to_sampling_params(None, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.95, 3, 0.05)
    assert params.repetition_penalty == 1.1


def test_without_defaults_temperature_is_one_like_vllm() -> None:
    params = CompletionRequest(prompt="a").to_sampling_params(None, {})
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 16)


def test_null_max_tokens_takes_the_server_default() -> None:
    request = CompletionRequest(prompt="a", max_tokens=None)
    assert request.to_sampling_params(100, {}).max_tokens == 100
    assert request.to_sampling_params(None, {}).max_tokens is None


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    assert CompletionRequest(prompt="a", echo=True, logprobs=2).to_sampling_params(None, {}).prompt_logprobs == 2
    assert CompletionRequest(prompt="a", logprobs=2).to_sampling_params(None, {}).prompt_logprobs is None


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_completion_tokens": 5, "max_tokens": 9}, 5),
        ({"max_tokens": 9}, 9),
        ({}, 100),
    ],
)
def test_chat_max_completion_tokens_wins_over_max_tokens(fields: dict[str, int], expected: int) -> None:
    request = ChatCompletionRequest(messages=MESSAGES, **fields)
    assert request.to_sampling_params(100, {}).max_tokens == expected


def test_chat_max_tokens_unbounded_without_default() -> None:
    assert ChatCompletionRequest(messages=MESSAGES).to_sampling_params(None, {}).max_tokens is None


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 4}, 4), ({"logprobs": False}, None)],
)
def test_chat_logprobs_map_to_top_logprobs(fields: dict[str, Any], expected: Any) -> None:
    assert ChatCompletionRequest(messages=MESSAGES, **fields).to_sampling_params(None, {}).logprobs == expected


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_stream_uses_delta_outputs(model: type) -> None:
    base = {"prompt": "a"} if model is CompletionRequest else {"messages": MESSAGES}
    streamed = model.model_validate({**base, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.stream_options.include_usage is True
    assert streamed.to_sampling_params(None, {}).output_kind == RequestOutputKind.DELTA
    assert model.model_validate(base).to_sampling_params(None, {}).output_kind == RequestOutputKind.FINAL_ONLY


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 500.0}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_out_of_range_sampling_values_are_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    # Bounds are schema constraints (so /openapi.json states them); rules between fields are SamplingParams'.
    try:
        request = CompletionRequest.model_validate({"prompt": "a", **fields})
    except ValidationError as exc:
        error = validation_error(exc.errors())
    else:
        with pytest.raises(OpenAIError) as info:
            request.to_sampling_params(None, {})
        error = info.value
    assert error.status_code == 400 and error.param.startswith(param)


@pytest.mark.parametrize(
    ("model", "payload", "param"),
    [
        (CompletionRequest, {"prompt": "a", "echo": 0}, "echo"),
        (CompletionRequest, {"prompt": "a", "stream": "true"}, "stream"),
        (CompletionRequest, {"prompt": "a", "max_tokens": 5.5}, "max_tokens"),
        (CompletionRequest, {"prompt": "a", "max_tokens": "5"}, "max_tokens"),
        (CompletionRequest, {"prompt": "a", "temperature": "0.5"}, "temperature"),
        (CompletionRequest, {"prompt": [True, 1]}, "prompt"),
        (CompletionRequest, {"prompt": "a", "stop_token_ids": [False]}, "stop_token_ids.0"),
        (DetokenizeRequest, {"tokens": [False]}, "tokens.0"),
        (ChatCompletionRequest, {"messages": MESSAGES, "logprobs": 1}, "logprobs"),
    ],
)
def test_types_are_strict_as_openai_s_are(model: type, payload: dict[str, Any], param: str) -> None:
    assert rejection(model, payload)["param"] == param


def test_numbers_follow_json_schema() -> None:
    # JSON Schema's "integer" includes 5.0, and "number" includes 1: both as the served document says.
    request = CompletionRequest.model_validate({"prompt": [1.0, 2], "temperature": 1, "max_tokens": 5.0})
    assert (request.temperature, request.max_tokens, request.prompts()) == (1.0, 5, [[1, 2]])


def test_invalid_generation_default_is_reported_too() -> None:
    with pytest.raises(OpenAIError) as info:
        CompletionRequest(prompt="a").to_sampling_params(None, {"top_p": 2.0})
    assert info.value.param == "top_p"


def test_sampling_error_guesses_the_param_from_the_message() -> None:
    assert sampling_error(ValueError("temperature must be a non-negative number, got -1.")).param == "temperature"
    assert sampling_error(ValueError("something else went wrong")).param is None
