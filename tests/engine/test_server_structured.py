"""Structured outputs, tool calling and reasoning through a real server and the real `openai` client.

The model is a tiny random-weight Qwen3 with a Qwen-style chat template: left alone it writes no valid JSON
and calls no tools, so every parsed object and tool call below exists only because the server enforced it.
"Scripted" outputs (a fixed hermes tool call, a fixed <think> block) are forced with a one-string choice, which
goes through the same parsers as a model's own text.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from server_helpers import start_server
from tiny_chat_model import build_tiny_chat_tokenizer

pytestmark = pytest.mark.slow  # starts real server processes

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Owner(BaseModel):
    # extra="forbid": additionalProperties false, so the schema itself rules out properties it does not list
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=6)
    level: int = Field(ge=0, le=9)


class Ticket(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: Literal["open", "closed"]
    priority: int = Field(ge=1, le=5)
    urgent: bool
    owner: Owner
    labels: list[Literal["bug", "docs", "ui"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def server(tiny_chat_qwen3):
    server = start_server(
        str(tiny_chat_qwen3),
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "32MiB",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def model_of(client) -> str:
    return client.models.list().data[0].id


# ---- structured outputs --------------------------------------------------------------------------------


def test_parse_returns_a_typed_object(client):
    for seed in range(5):
        completion = client.chat.completions.parse(
            model=model_of(client),
            messages=[{"role": "user", "content": "File a ticket"}],
            response_format=Ticket,
            temperature=1.0,
            seed=seed,
            max_completion_tokens=300,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Ticket)


def test_json_schema_streamed_with_n_2(client):
    schema = Ticket.model_json_schema()
    stream = client.chat.completions.create(
        model=model_of(client),
        messages=[{"role": "user", "content": "Two tickets"}],
        response_format={"type": "json_schema", "json_schema": {"name": "ticket", "schema": schema, "strict": True}},
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=300,
        stream=True,
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        Ticket.model_validate(json.loads(text))


def test_json_object_regex_and_choice_through_both_endpoints(client):
    model = model_of(client)
    chat = client.chat.completions.create(
        model=model, messages=ASK, response_format={"type": "json_object"}, temperature=1.0, seed=1, max_tokens=600
    )
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    assert "\n" not in chat.choices[0].message.content  # compact JSON: no free whitespace to loop on
    regex = r"[A-Z]{2}-[0-9]{4}"
    completion = client.completions.create(
        model=model, prompt="Code:", extra_body={"guided_regex": regex}, temperature=1.0, n=5, seed=2, max_tokens=20
    )
    assert all(__import__("re").fullmatch(regex, c.text) for c in completion.choices)
    chosen = client.chat.completions.create(
        model=model,
        messages=ASK,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
        temperature=1.0,
        max_tokens=10,
    )
    assert chosen.choices[0].message.content in ("sunny", "rainy")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"guided_regex": "[0-9"}, "guided_regex", "guided_regex could not be compiled"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
            "is not a valid JSON Schema",
        ),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "could not be compiled"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools",
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", None),
        ({"structured_outputs": {"json_object": {}}}, "structured_outputs", "true or false"),
        ({"guided_choice": ["a", "b"], "min_tokens": 3}, "min_tokens", "cannot be combined"),
    ],
)
def test_constraints_that_cannot_be_served_are_400s_naming_the_field(server, extra, param, message, stream):
    body = {"messages": ASK, "max_tokens": 5, "stream": stream, **extra}
    status, _, payload = server.request("POST", "/v1/chat/completions", body)
    assert status == 400, payload
    assert payload["error"]["param"] == param
    if message is not None:
        assert message in payload["error"]["message"]
    assert "Traceback" not in payload["error"]["message"] and ".cc:" not in payload["error"]["message"]
    status, _, _ = server.request("POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 3})
    assert status == 200  # and the server carries on


# ---- tools ---------------------------------------------------------------------------------------------


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_round_trip(client, tool_choice, stream):
    """The model calls a tool, the client answers with a tool message, and the model continues."""
    model = model_of(client)
    kwargs = dict(model=model, tools=TOOLS, temperature=1.0, seed=4, max_tokens=400, parallel_tool_calls=False)
    if stream:
        calls, finish = _reassemble(
            client.chat.completions.create(messages=ASK, tool_choice=tool_choice, stream=True, **kwargs)
        )
        tool_calls = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()
        ]
        assistant = {"role": "assistant", "content": None, "tool_calls": tool_calls}
    else:
        first = client.chat.completions.create(messages=ASK, tool_choice=tool_choice, **kwargs)
        choice, finish = first.choices[0], first.choices[0].finish_reason
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls)
        assistant = choice.message.model_dump(exclude_none=True)
        tool_calls = assistant["tool_calls"]
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")
    assert len(tool_calls) == 1
    if tool_choice != "required":
        assert tool_calls[0]["function"]["name"] == "get_weather"
    for call in tool_calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
    result = [{"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 21}'} for c in tool_calls]
    messages = [*ASK, assistant, *result]
    before = client.chat.completions.create(messages=ASK, tool_choice="auto", **{**kwargs, "max_tokens": 1})
    after = client.chat.completions.create(messages=messages, tool_choice="auto", stream=False, **kwargs)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert after.usage.prompt_tokens > before.usage.prompt_tokens  # the call and its result reached the template


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_streamed_reassemble(client, parallel):
    stream = client.chat.completions.create(
        model=model_of(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=1.0,
        seed=8,
        max_tokens=400,
        stream=True,
    )
    calls, finish = _reassemble(stream)
    assert finish == "tool_calls"
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_is_called(client, stream):
    kwargs = dict(
        model=model_of(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=5,
        max_tokens=100,
    )
    if stream:
        calls, finish = _reassemble(client.chat.completions.create(stream=True, **kwargs))
        (call,) = calls.values()
        name, arguments = call["name"], call["arguments"]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        (tool_call,) = choice.message.tool_calls
        name, arguments = tool_call.function.name, tool_call.function.arguments
    assert finish == "stop" and name == "get_time"  # a forced call ends with "stop", as OpenAI's does
    jsonschema.validate(json.loads(arguments), PARAMETERS["get_time"])


HERMES_OUTPUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_a_hermes_tool_call_in_the_output_becomes_tool_calls(client, stream):
    kwargs = dict(model=model_of(client), messages=ASK, tools=TOOLS, max_tokens=200)
    kwargs["extra_body"] = {"guided_choice": [HERMES_OUTPUT]}  # the "model" writes exactly this
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls, finish = _reassemble(iter(chunks))
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = {
            i: {"name": c.function.name, "arguments": c.function.arguments}
            for i, c in enumerate(choice.message.tool_calls)
        }
    assert finish == "tool_calls"
    assert content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]


def test_auto_tool_choice_needs_the_server_flags_and_a_grammar_skips_the_reasoning_parser(tiny_chat_qwen3):
    server = start_server(
        str(tiny_chat_qwen3),
        "--max-model-len",
        "1024",
        "--tokenizer-pool-type",
        "thread",
        "--reasoning-parser",
        "deepseek_r1",  # reads text without </think> as reasoning: a grammar-shaped output must bypass it
    )
    try:
        body = {"messages": ASK, "guided_choice": ["forty-two"], "max_tokens": 20}
        status, _, payload = server.request("POST", "/v1/chat/completions", body)
        assert status == 200, payload
        assert payload["choices"][0]["message"]["content"] == "forty-two"
        status, _, payload = server.request("POST", "/v1/chat/completions", {"messages": ASK, "tools": TOOLS})
        assert status == 400 and payload["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in payload["error"]["message"]
        body = {
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 300,
        }
        status, _, payload = server.request("POST", "/v1/chat/completions", body)
        assert status == 200, payload
        assert payload["choices"][0]["message"]["tool_calls"]
    finally:
        server.stop()


# ---- reasoning and the template --------------------------------------------------------------------------

THINKING = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_from_the_answer(client, stream):
    kwargs = dict(model=model_of(client), messages=ASK, max_tokens=100, extra_body={"guided_choice": [THINKING]})
    if stream:
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning.strip() == "The user wants weather."
    assert content == "It is sunny."


def test_chat_template_kwargs_reach_the_template(client):
    tokenizer = build_tiny_chat_tokenizer()
    thinking = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)
    silent = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, enable_thinking=False)
    model = model_of(client)
    usage_of = lambda **extra: client.chat.completions.create(model=model, messages=ASK, max_tokens=1, **extra).usage
    assert usage_of().prompt_tokens == len(_ids(thinking))
    off = usage_of(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.prompt_tokens == len(_ids(silent)) > len(_ids(thinking))


def test_continue_final_message(client):
    messages = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    completion = client.chat.completions.create(
        model=model_of(client),
        messages=messages,
        max_tokens=4,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    tokenizer = build_tiny_chat_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    assert completion.usage.prompt_tokens == len(_ids(rendered))


def _ids(rendered) -> list[int]:
    return rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else list(rendered)


def _reassemble(stream) -> tuple[dict[int, dict[str, str]], str]:
    """Tool calls from streamed deltas, as a client library accumulates them: by index, id and name from the
    first fragment, arguments concatenated."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for fragment in choice.delta.tool_calls or []:
                call = calls.setdefault(fragment.index, {"id": "", "name": "", "arguments": ""})
                if fragment.id:
                    assert not call["id"], "an id is sent once per call"
                    call["id"] = fragment.id
                if fragment.function and fragment.function.name:
                    call["name"] = fragment.function.name
                if fragment.function and fragment.function.arguments:
                    call["arguments"] += fragment.function.arguments
            finish = choice.finish_reason or finish
    assert all(c["id"] and c["name"] for c in calls.values())
    return calls, finish
