"""``POST /v1/responses`` (OpenAI's Responses API) through a real server and the official `openai` client.

The model is the tiny random-weight Qwen3 with a Qwen-style chat template: it writes gibberish, so every parsed
object, function call and reasoning item below exists because the server enforced or parsed it. Scripted
outputs (a hermes tool call, a <think> block) are forced with a one-string ``structured_outputs`` choice (a vLLM
extension the Responses endpoint takes too), which goes through the same parsers as a model's own text.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import start_server

from pagoda.entrypoints.openai import errors as openai_errors
from pagoda.entrypoints.openai.protocol_responses import input_messages
from pagoda.entrypoints.openai.response_store import ResponseStore

pytestmark = pytest.mark.slow  # starts a real server process

MAX_STORED = 4
WEATHER = {
    "type": "function",
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
}
CLOCK = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
}
TICKET = {
    "type": "object",
    "properties": {"status": {"enum": ["open", "closed"]}, "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["status", "priority"],
    "additionalProperties": False,
}
# Thinking off: no reasoning parser for the request, so text streams as it comes (qwen3's parser holds untagged
# output back until it knows whether a </think> follows).
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
HERMES_OUTPUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


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
        "--max-stored-responses",
        str(MAX_STORED),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def model_of(client) -> str:
    return client.models.list().data[0].id


def tokens_of(server, messages: list[dict]) -> int:
    """What the chat template makes of ``messages`` (the server's /tokenize), in tokens."""
    status, _, body = server.request("POST", "/tokenize", {"messages": messages})
    assert status == 200, body
    return body["count"]


def test_a_text_response_is_stored_and_read_back(server, client):
    response = client.responses.create(
        input="Tell me a story", instructions="Be brief.", max_output_tokens=12, temperature=1.0, extra_body={"seed": 1}
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.usage.output_tokens <= 12
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # instructions are the system message, input the user's, rendered by the model's template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    assert response.usage.input_tokens == tokens_of(server, messages)
    assert response.max_output_tokens == 12 and response.temperature == 1.0
    stored = client.responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()
    ignored = client.responses.create(input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.responses.retrieve(ignored.id)
    assert excinfo.value.body["code"] == "response_not_found"


def _check_event_order(events) -> None:
    """The Responses API's event grammar: created, in_progress, then per item added [part added, deltas, done,
    part done] done, then completed or incomplete; sequence numbers count from 0."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    position = 2
    while kinds[position] == "response.output_item.added":
        item = events[position].item
        position += 1
        if item.type == "function_call":
            while kinds[position] == "response.function_call_arguments.delta":
                position += 1
            assert kinds[position] == "response.function_call_arguments.done"
            position += 1
        else:
            text = "output_text" if item.type == "message" else "reasoning_text"
            assert kinds[position] == "response.content_part.added"
            position += 1
            while kinds[position] == f"response.{text}.delta":
                position += 1
            assert kinds[position : position + 2] == [f"response.{text}.done", "response.content_part.done"]
            position += 2
        assert kinds[position] == "response.output_item.done"
        assert events[position].item.id == item.id
        position += 1
    assert position == len(kinds) - 1


def test_a_streamed_response_sends_the_events_in_order(client):
    with client.responses.stream(
        model=model_of(client),
        input="Say something",
        max_output_tokens=64,
        temperature=1.0,
        extra_body={"seed": 2, **NO_THINKING},
    ) as stream:
        events = list(stream)
    _check_event_order(events)
    final = events[-1].response  # completed, or incomplete at max_output_tokens
    assert final.status == ("completed" if events[-1].type == "response.completed" else "incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert sum(e.type == "response.output_text.delta" for e in events) > 1
    assert deltas == final.output_text
    assert final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == final.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(server, client, stream):
    """A forced call comes back as a function_call item; its output goes back as a function_call_output item
    (stateless: the whole conversation as input; or after previous_response_id), and the model answers."""
    ask = {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}
    kwargs = dict(tools=[WEATHER, CLOCK], temperature=1.0, extra_body={"seed": 4}, max_output_tokens=200, store=False)
    stored, answer = {**kwargs, "store": True}, {**kwargs, "max_output_tokens": 4}
    choice = {"type": "function", "name": "get_weather"} if stream else "required"
    if stream:
        with client.responses.stream(
            model=model_of(client), input=[ask], tool_choice=choice, parallel_tool_calls=False, **stored
        ) as s:
            events = list(s)
            first = s.get_final_response()
        _check_event_order(events)
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert arguments == first.output[0].arguments
    else:
        first = client.responses.create(input=[ask], tool_choice=choice, parallel_tool_calls=False, **stored)
    (call,) = first.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    assert call.name == "get_weather" or not stream
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    second = client.responses.create(
        input=[ask, call.model_dump(exclude_none=True), result], tool_choice="none", **answer
    )
    assert all(item.type in ("message", "reasoning") for item in second.output)
    function = {"name": call.name, "arguments": call.arguments}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.call_id, "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'},
    ]
    assert second.usage.input_tokens == tokens_of(server, messages)  # the call and its result reached the template
    third = client.responses.create(input=[result], previous_response_id=first.id, tool_choice="none", **answer)
    assert third.usage.input_tokens == second.usage.input_tokens  # the stored call renders as the one sent back


@pytest.mark.parametrize("stream", [False, True])
def test_hermes_calls_and_reasoning_are_parsed_into_items(client, stream):
    scripted = "<think>\nWeather first.\n</think>\n\n" + HERMES_OUTPUT
    kwargs = dict(input="Weather?", tools=[WEATHER, CLOCK], max_output_tokens=200)
    kwargs["extra_body"] = {"structured_outputs": {"choice": [scripted]}}
    if stream:
        with client.responses.stream(model=model_of(client), **kwargs) as s:
            events = list(s)
            response = s.get_final_response()
        _check_event_order(events)
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning.strip() == "Weather first."
    else:
        response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text.strip() == "Weather first."
    assert response.output_text.strip() == "Let me check."
    calls = [(item.name, json.loads(item.arguments)) for item in response.output[2:]]
    assert calls == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_parses_against_the_schema(client, stream):
    text = {"format": {"type": "json_schema", "name": "ticket", "schema": TICKET, "strict": True}}
    kwargs = dict(input="File a ticket", text=text, temperature=1.0, extra_body={"seed": 3}, max_output_tokens=200)
    if stream:
        with client.responses.stream(model=model_of(client), **kwargs) as s:
            response = s.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), TICKET)
    assert response.text.format.type == "json_schema"
    loose = client.responses.create(
        input="Any JSON",
        text={"format": {"type": "json_object"}},
        temperature=1.0,
        extra_body={"seed": 5},
        max_output_tokens=60,
    )
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)


def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(input="Hello", max_output_tokens=8, temperature=1.0, extra_body={"seed": 6})
    second = client.responses.create(
        input="And then?",
        previous_response_id=first.id,
        instructions="Be kind.",
        max_output_tokens=4,
        extra_body={"seed": 7},
    )
    assert second.previous_response_id == first.id
    reply = {"role": "assistant", "content": first.output_text or None}
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello"},
        reply,
        {"role": "user", "content": "And then?"},
    ]
    assert second.usage.input_tokens == tokens_of(server, messages)
    # the chain goes on: the third turn sees both before it, the first one's instructions are not carried over
    third = client.responses.create(input="Bye", previous_response_id=second.id, max_output_tokens=2)
    messages = [
        *messages[1:],
        {"role": "assistant", "content": second.output_text or None},
        {"role": "user", "content": "Bye"},
    ]
    assert third.usage.input_tokens == tokens_of(server, messages)


def test_the_store_evicts_the_least_recently_used_and_deletes(client):
    ids = [client.responses.create(input=f"n{i}", max_output_tokens=1).id for i in range(MAX_STORED)]
    client.responses.retrieve(ids[0])  # now the most recently used
    newest = client.responses.create(input="one more", max_output_tokens=1).id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in (ids[0], *ids[2:], newest):
        assert client.responses.retrieve(kept).id == kept
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="x", previous_response_id=ids[1], max_output_tokens=1)
    client.responses.delete(newest)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(newest)


def test_a_running_response_is_cancelled(client):
    """POST /v1/responses/{id}/cancel stops a stored response while it streams (900 tokens take ~25 s here)."""
    stream = client.responses.create(
        input="Go on",
        max_output_tokens=900,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True, **NO_THINKING},
    )
    events = iter(stream)
    response_id = next(events).response.id
    assert client.responses.retrieve(response_id).status == "in_progress"
    seen = [next(e for e in events if e.type == "response.output_text.delta")]
    # the stream is not read meanwhile: the cancel stops the engine request whether or not its client reads
    assert client.responses.cancel(response_id).status == "cancelled"
    seen += list(events)
    last = seen[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    assert 1 <= last.response.usage.output_tokens < 900
    assert client.responses.retrieve(response_id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(response_id)  # it has ended
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "built-in tool 'web_search'"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools", "'code_interpreter'"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools", "tools[0].name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
        ({"background": True}, "background", "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, "text.format.schema", None),
        ({"n": 2}, "n", None),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(server, body, param, message):
    status, _, payload = server.request("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2, **body})
    assert status == 400, payload
    assert payload["error"]["param"] == param
    if message is not None:
        assert message in payload["error"]["message"]


def test_input_items_become_the_chat_messages_of_the_template():
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "UTC"}'}
    items = [
        {"role": "developer", "content": "Use tools."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Time "}, {"type": "input_text", "text": "now?"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Ask the clock."}],
        },
        call,
        {**call, "call_id": "call_2", "arguments": '{"zone": "CET"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "13:00"}]},
    ]
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Time now?"},
        {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "Ask the clock."},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_2", "content": "13:00"},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"^input\[0\]\.call_id: must be a string"):
        input_messages([{**call, "call_id": 5}])
    with pytest.raises(ValueError, match=r"^input\[1\]\.role:"):
        input_messages([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])


def test_the_store_is_bounded_by_bytes_too():
    def body(i: int, size: int) -> dict:
        return {"id": f"resp_{i}", "status": "completed", "text": "x" * size}

    store = ResponseStore(max_responses=100, max_bytes=3000)
    for i in range(3):
        store.finish(store.begin(body(i, 900)), body(i, 900), [])
    assert len(store) == 3
    store.finish(store.begin(body(3, 900)), body(3, 900), [])  # a fourth does not fit: the oldest goes
    assert len(store) == 3
    with pytest.raises(openai_errors.OpenAIError):
        store.get("resp_0")
    store.begin(body(4, 5000))  # larger than the whole bound: never kept
    with pytest.raises(openai_errors.OpenAIError) as excinfo:
        store.get("resp_4")
    assert excinfo.value.status_code == 404
    assert store.get("resp_3").body["text"] == "x" * 900
