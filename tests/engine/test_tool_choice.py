"""tools / tool_choice: validation errors name the field, and the forcing schemas accept exactly the right outputs."""

import json
import re

import jsonschema
import pytest

from pagoda.entrypoints.openai.tool_choice import (
    TOOL_CHOICE_MODES,
    named_tool_call,
    named_tool_schema,
    parse_required_output,
    required_tool_calls_schema,
    resolve_tool_choice,
    validate_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# Refers to its own $defs: must still resolve once embedded in the "required" schema.
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "$defs": {"num": {"type": "number"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/num"}, "b": {"$ref": "#/$defs/num"}},
            "required": ["a", "b"],
        },
        "strict": True,
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}
TOOLS = validate_tools([WEATHER, ADD, NO_PARAMS])


def is_valid(schema: dict, instance: object) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(instance)


# --- validate_tools ---


def test_validate_tools_normalises():
    assert TOOLS[0] == WEATHER
    assert TOOLS[1]["function"]["strict"] is True
    assert TOOLS[2] == {
        "type": "function",
        "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
    }
    extra = {"type": "function", "function": {"name": "x", "description": None, "strict": None, "other": 1}, "more": 2}
    assert validate_tools([extra]) == [
        {"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {}}}}
    ]
    assert validate_tools([]) == []


@pytest.mark.parametrize(
    "tools, path",
    [
        ({"type": "function"}, "tools:"),
        (["nope"], "tools[0]:"),
        ([{"function": {"name": "a"}}], "tools[0].type:"),
        ([{"type": "retrieval", "function": {"name": "a"}}], "tools[0].type:"),
        ([{"type": "function"}], "tools[0].function:"),
        ([NO_PARAMS, {"type": "function", "function": {"name": "has space"}}], "tools[1].function.name:"),
        ([{"type": "function", "function": {"name": "a" * 65}}], "tools[0].function.name:"),
        ([{"type": "function", "function": {"name": "a\n"}}], "tools[0].function.name:"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name:"),
        ([{"type": "function", "function": {"name": 5}}], "tools[0].function.name:"),
        ([{"type": "function", "function": {"name": "a", "description": 1}}], "tools[0].function.description:"),
        ([{"type": "function", "function": {"name": "a", "strict": "yes"}}], "tools[0].function.strict:"),
        ([{"type": "function", "function": {"name": "a", "parameters": []}}], "tools[0].function.parameters:"),
        (
            [NO_PARAMS, {"type": "function", "function": {"name": "a", "parameters": {"type": "objekt"}}}],
            "tools[1].function.parameters.type:",
        ),
        (
            [{"type": "function", "function": {"name": "a", "parameters": {"properties": {"x": {"minLength": -1}}}}}],
            "tools[0].function.parameters.properties.x.minLength:",
        ),
        (
            [{"type": "function", "function": {"name": "a", "parameters": {"$schema": ["draft"]}}}],
            "tools[0].function.parameters.$schema:",
        ),
        ([NO_PARAMS, ADD, NO_PARAMS], "tools[2].function.name: duplicate"),
    ],
)
def test_validate_tools_errors_name_the_path(tools, path):
    with pytest.raises(ValueError) as excinfo:
        validate_tools(tools)
    assert str(excinfo.value).startswith(path), str(excinfo.value)


def test_validate_tools_honours_the_declared_dialect():
    # draft-04 wants a boolean exclusiveMaximum; 2020-12 (the default) a number.
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "maximum": 5, "exclusiveMaximum": True}
    validate_tools([{"type": "function", "function": {"name": "a", "parameters": draft4}}])
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters\.exclusiveMaximum:"):
        validate_tools([{"type": "function", "function": {"name": "a", "parameters": {"exclusiveMaximum": True}}}])


# --- resolve_tool_choice ---


@pytest.mark.parametrize(
    "choice, tools, expected",
    [
        (None, TOOLS, ("auto", None)),
        (None, None, ("none", None)),
        (None, [], ("none", None)),
        ("none", TOOLS, ("none", None)),
        ("none", None, ("none", None)),
        ("auto", TOOLS, ("auto", None)),
        ("required", TOOLS, ("required", None)),
        ({"type": "function", "function": {"name": "add"}}, TOOLS, ("named", "add")),
    ],
)
def test_resolve_tool_choice(choice, tools, expected):
    assert resolve_tool_choice(choice, tools) == expected
    assert expected[0] in TOOL_CHOICE_MODES


@pytest.mark.parametrize(
    "choice, tools, prefix",
    [
        ("auto", None, "tool_choice:"),
        ("required", [], "tool_choice:"),
        ({"type": "function", "function": {"name": "add"}}, None, "tool_choice:"),
        ("any", TOOLS, "tool_choice:"),
        (3, TOOLS, "tool_choice:"),
        ({"type": "tool", "function": {"name": "add"}}, TOOLS, "tool_choice.type:"),
        ({"type": "function"}, TOOLS, "tool_choice.function.name:"),
        ({"type": "function", "function": {"name": 1}}, TOOLS, "tool_choice.function.name:"),
        ({"type": "function", "function": {"name": "sub"}}, TOOLS, "tool_choice.function.name:"),
    ],
)
def test_resolve_tool_choice_errors(choice, tools, prefix):
    with pytest.raises(ValueError, match="^" + re.escape(prefix)):
        resolve_tool_choice(choice, tools)


# --- required ---


def test_required_schema_is_a_valid_schema():
    for parallel in (True, False):
        schema = required_tool_calls_schema(TOOLS, parallel)
        jsonschema.validators.validator_for(schema).check_schema(schema)
        assert ("maxItems" in schema) is not parallel


GOOD_CALLS = [
    {"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}},
    {"name": "add", "parameters": {"a": 1, "b": 2.5}},
    {"name": "ping", "parameters": {}},
]


@pytest.mark.parametrize(
    "instance, parallel_ok, single_ok",
    [
        (GOOD_CALLS[:1], True, True),
        (GOOD_CALLS, True, False),
        ([GOOD_CALLS[1], GOOD_CALLS[1]], True, False),
        ([], False, False),
        ({"name": "ping", "parameters": {}}, False, False),  # not an array
        ([{"name": "nope", "parameters": {}}], False, False),
        ([{"name": "ping"}], False, False),  # parameters missing
        ([{"parameters": {}}], False, False),
        ([{"name": "ping", "parameters": {}, "id": 1}], False, False),  # extra key
        ([{"name": "add", "parameters": {"a": "1", "b": 2}}], False, False),  # $ref'd type enforced
        ([{"name": "add", "parameters": {"a": 1}}], False, False),
        ([{"name": "get_weather", "parameters": {"city": "Paris", "wind": 1}}], False, False),
        ([{"name": "get_weather", "parameters": {"a": 1, "b": 2}}], False, False),  # another tool's arguments
    ],
)
def test_required_schema_accepts_exactly_the_right_outputs(instance, parallel_ok, single_ok):
    assert is_valid(required_tool_calls_schema(TOOLS, True), instance) is parallel_ok
    assert is_valid(required_tool_calls_schema(TOOLS, False), instance) is single_ok


def test_required_schema_leaves_data_alone_and_inputs_untouched():
    tool = {
        "type": "function",
        "function": {
            "name": "t",
            "parameters": {"type": "object", "default": {"$ref": "#/x"}, "enum": [{"$ref": "#"}]},
        },
    }
    tools = validate_tools([tool])
    before = json.dumps(tools)
    schema = required_tool_calls_schema(tools, True)
    parameters = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert parameters["default"] == {"$ref": "#/x"} and parameters["enum"] == [{"$ref": "#"}]
    assert json.dumps(tools) == before


def test_required_schema_without_tools():
    with pytest.raises(ValueError, match="^tool_choice:"):
        required_tool_calls_schema([], True)


def test_parse_required_output_round_trip():
    schema = required_tool_calls_schema(TOOLS, True)
    text = json.dumps(GOOD_CALLS, ensure_ascii=False)
    assert is_valid(schema, json.loads(text))
    calls = parse_required_output(text)
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        (call["name"], call["parameters"]) for call in GOOD_CALLS
    ]
    assert len({call.id for call in calls}) == 3 and all(call.id.startswith("call_") for call in calls)
    unicode = parse_required_output('[{"name": "get_weather", "parameters": {"city": "Zürich 東京"}}]')
    assert unicode[0].arguments == '{"city": "Zürich 東京"}'


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[",  # cut short by the length limit
        "[]",
        '{"name": "a", "parameters": {}}',
        "[1]",
        '[{"parameters": {}}]',
        '[{"name": "", "parameters": {}}]',
        '[{"name": "a"}]',
        '[{"name": "a", "parameters": [1]}]',
        '[{"name": "a", "parameters": {"x": NaN}}]',
    ],
)
def test_parse_required_output_errors(text):
    with pytest.raises(ValueError):
        parse_required_output(text)


# --- named ---


def test_named_schema():
    schema = named_tool_schema(TOOLS, "add")
    assert schema == ADD["function"]["parameters"]
    assert is_valid(schema, {"a": 1, "b": 2}) and not is_valid(schema, {"a": "x", "b": 2})
    schema["properties"] = {}  # a copy: the tool is not changed
    assert TOOLS[1]["function"]["parameters"]["properties"]
    assert named_tool_schema(TOOLS, "ping") == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="^tool_choice.function.name:"):
        named_tool_schema(TOOLS, "nope")


def test_named_tool_call():
    call = named_tool_call("get_weather", ' {"city" :"Köln",\n"unit": "C"} ')
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Köln", "unit": "C"}')
    assert call.id.startswith("call_")
    for text in ['{"city": "Kö', "[1]", "null", ""]:
        with pytest.raises(ValueError, match="get_weather"):
            named_tool_call("get_weather", text)


def test_required_schema_compiles_with_xgrammar():
    """The grammar backend resolves the rebased $refs, also when two tools use the same $defs name."""
    xgr = pytest.importorskip("xgrammar")

    def tool(name: str, kind: str) -> dict:
        parameters = {
            "$defs": {"value": {"type": kind}},
            "type": "object",
            "properties": {"v": {"$ref": "#/$defs/value"}},
            "required": ["v"],
            "additionalProperties": False,
        }
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    schema = required_tool_calls_schema(validate_tools([tool("i", "integer"), tool("s", "string")]), True)
    vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
    tokenizer = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiled = xgr.GrammarCompiler(tokenizer).compile_json_schema(json.dumps(schema))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(len(vocab) - 1)

    assert accepts('[{"name": "i", "parameters": {"v": 5}}, {"name": "s", "parameters": {"v": "x"}}]')
    assert not accepts('[{"name": "i", "parameters": {"v": "x"}}]')
    assert not accepts('[{"name": "s", "parameters": {"v": 5}}]')
