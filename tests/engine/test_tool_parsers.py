"""Tool-call parsers: every format rule on examples, and streaming == non-streaming for any split of the output."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parser_helpers import split

from pagoda.entrypoints.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    ExtractedToolCalls,
    ToolParser,
    get_tool_parser,
    new_mistral_tool_call_id,
    new_tool_call_id,
    parse_json,
)

HERMES = get_tool_parser("hermes")
LLAMA3 = get_tool_parser("llama3_json")
MISTRAL = get_tool_parser("mistral")

NESTED_ARGS = {"query": "naïve café 日本 🙂", "filters": [{"k": [1, 2.5, None]}, {"deep": {"x": [True, False]}}]}


def calls_of(result: ExtractedToolCalls) -> list[tuple[str, dict]]:
    """(name, parsed arguments) of each call; also checks the arguments are JSON text of an object."""
    out = []
    for call in result.tool_calls:
        arguments = json.loads(call.arguments)
        assert isinstance(arguments, dict)
        out.append((call.name, arguments))
    return out


def hermes_block(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def stream(parser: ToolParser, chunks: list[str]) -> tuple[str, list[tuple[str, str, str]], bool]:
    """Run a streamer over ``chunks``: (content, [(id, name, arguments)] by index, called_tools)."""
    streamer = parser.streamer()
    messages = [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]
    content = "".join(message.content for message in messages)
    calls: dict[int, list[str]] = {}
    for message in messages:
        for delta in message.tool_calls:
            if delta.index not in calls:
                assert delta.id and delta.name, "the first delta of a call carries its id and name"
                calls[delta.index] = [delta.id, delta.name, delta.arguments]
            else:
                assert delta.id is None and delta.name is None, "later deltas carry only arguments"
                calls[delta.index][2] += delta.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in range(len(calls))], streamer.called_tools


def assert_stream_matches(parser: ToolParser, text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    expected = parser.extract(text)
    content, calls, called = stream(parser, chunks)
    assert content == (expected.content or "")
    assert [(name, arguments) for _, name, arguments in calls] == [
        (call.name, call.arguments) for call in expected.tool_calls
    ]
    assert called == bool(expected.tool_calls)


# --- registry and ids ---


def test_registry_names():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    for name, cls in TOOL_CALL_PARSERS.items():
        parser = get_tool_parser(name)
        assert isinstance(parser, cls) and parser.name == name


def test_unknown_parser_lists_known_names():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("nope")


def test_ids():
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", new_mistral_tool_call_id()) for _ in range(100))


def test_parse_json_rejects_non_json_constants_and_deep_nesting():
    assert parse_json(' {"a": "line\nbreak"} ') == {"a": "line\nbreak"}  # raw newline in a string: accepted
    for text in ["NaN", '{"a": Infinity}', "{} {}", "", "[" * 100_000]:
        with pytest.raises(ValueError):
            parse_json(text)


# --- hermes ---


def test_hermes_no_calls_is_content():
    assert HERMES.extract("Just text.") == ExtractedToolCalls("Just text.", ())
    assert HERMES.extract("") == ExtractedToolCalls("", ())


def test_hermes_single_call():
    result = HERMES.extract(hermes_block("get_weather", {"city": "Paris"}))
    assert result.content is None
    assert calls_of(result) == [("get_weather", {"city": "Paris"})]
    assert result.tool_calls[0].arguments == '{"city": "Paris"}'
    assert result.tool_calls[0].id.startswith("call_")


def test_hermes_multiple_calls_and_content_before():
    text = "Let me check.\n" + hermes_block("a", {"x": 1}) + "\n" + hermes_block("b", {})
    result = HERMES.extract(text)
    assert result.content == "Let me check.\n"
    assert calls_of(result) == [("a", {"x": 1}), ("b", {})]
    assert len({call.id for call in result.tool_calls}) == 2


def test_hermes_whitespace_only_content_is_none():
    assert HERMES.extract("\n\n " + hermes_block("a", {})).content is None


def test_hermes_unicode_and_nested_arguments():
    result = HERMES.extract(hermes_block("search", NESTED_ARGS))
    assert calls_of(result) == [("search", NESTED_ARGS)]
    assert "日本 🙂" in result.tool_calls[0].arguments  # not \u-escaped


def test_hermes_arguments_are_reserialised():
    text = '<tool_call>{"name":"f","arguments":{"a" :1,\n"b":[ ]}}</tool_call>'
    assert HERMES.extract(text).tool_calls[0].arguments == '{"a": 1, "b": []}'


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {"a": 1}',  # invalid JSON
        '{"arguments": {"a": 1}}',  # no name
        '{"name": 3, "arguments": {}}',  # name not a string
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": [1]}',  # arguments not an object
        '{"name": "f", "arguments": {"a": NaN}}',
        '["f"]',
        "",
    ],
)
def test_hermes_invalid_block_makes_everything_content(body):
    text = "Hi " + hermes_block("ok", {}) + "<tool_call>" + body + "</tool_call>"
    assert HERMES.extract(text) == ExtractedToolCalls(text, ())


def test_hermes_unterminated_final_call():
    text = "x" + hermes_block("a", {}) + '<tool_call>\n{"name": "b", "arguments": {"y": 2}}\n'
    assert calls_of(HERMES.extract(text)) == [("a", {}), ("b", {"y": 2})]
    cut = text[:-4]  # the JSON itself is cut short
    assert HERMES.extract(cut) == ExtractedToolCalls(cut, ())
    assert HERMES.extract("a<tool_call>") == ExtractedToolCalls("a<tool_call>", ())


def test_hermes_leniencies():
    # "parameters" for "arguments", arguments double-encoded as a string, arguments missing: all accepted.
    text = (
        '<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    assert calls_of(HERMES.extract(text)) == [("a", {"x": 1}), ("b", {"y": 2}), ("c", {})]


def test_hermes_text_between_and_after_blocks_is_dropped():
    text = "pre" + hermes_block("a", {}) + " mid " + hermes_block("b", {}) + " after"
    result = HERMES.extract(text)
    assert result.content == "pre"
    assert [call.name for call in result.tool_calls] == ["a", "b"]


# --- llama3_json ---


def test_llama3_single_call_with_and_without_tag():
    body = json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}})
    for text in [body, "<|python_tag|>" + body, "\n <|python_tag|> " + body + "\n"]:
        result = LLAMA3.extract(text)
        assert result.content is None
        assert calls_of(result) == [("get_weather", {"city": "Paris"})]


def test_llama3_multiple_calls_separated_by_semicolons():
    a = json.dumps({"name": "a", "parameters": NESTED_ARGS}, ensure_ascii=False)
    b = json.dumps({"name": "b", "arguments": {"k": "v"}})
    for text in [f"{a};{b}", f"{a} ;\n {b}", f"{a}; {b};", f"<|python_tag|>{a}; {b}"]:
        assert calls_of(LLAMA3.extract(text)) == [("a", NESTED_ARGS), ("b", {"k": "v"})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is nice.",
        'Sure: {"name": "f", "parameters": {}}',  # does not start with {
        "<|python_tag|>print(1)",
        '{"name": "f", "parameters": {}',  # invalid JSON
        '{"parameters": {}}',  # no name
        '{"name": "f", "parameters": {}} and more',  # trailing text
        '{"name": "f", "parameters": {}} {"name": "g", "parameters": {}}',  # no separator
        '{"name": "f", "parameters": {}}; 42',
        "",
        "   ",
    ],
)
def test_llama3_content(text):
    assert LLAMA3.extract(text) == ExtractedToolCalls(text, ())


# --- mistral ---


def test_mistral_json_array():
    text = '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": [1, {"z": "ß"}]}}]'
    result = MISTRAL.extract(text)
    assert result.content is None
    assert calls_of(result) == [("a", {"x": 1}), ("b", {"y": [1, {"z": "ß"}]})]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in result.tool_calls)


def test_mistral_content_before_and_trailing_text_after_array():
    text = 'Checking.[TOOL_CALLS][{"name": "a", "arguments": {}}]\nextra'
    result = MISTRAL.extract(text)
    assert result.content == "Checking."
    assert calls_of(result) == [("a", {})]


def test_mistral_v11_segments():
    text = 'Sure.[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]search[ARGS]' + json.dumps(NESTED_ARGS)
    result = MISTRAL.extract(text)
    assert result.content == "Sure."
    assert calls_of(result) == [("add", {"a": 3.5, "b": 4}), ("search", NESTED_ARGS)]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in result.tool_calls)


def test_mistral_v11_variants():
    # [ARGS] dropped by the detokenizer, [CALL_ID] of v13 templates, several calls after one marker.
    text = '[TOOL_CALLS]add{"a": 1}[TOOL_CALLS]mul[CALL_ID]abc123XYZ[ARGS]{"b": 2} div[ARGS]{}\n'
    assert calls_of(MISTRAL.extract(text)) == [("add", {"a": 1}), ("mul", {"b": 2}), ("div", {})]


@pytest.mark.parametrize(
    "tail",
    [
        " not json",
        "[]",
        '[{"name": "a", "arguments": {}}',  # unterminated array
        '[{"name": "a", "arguments": {}}, 3]',
        'add[ARGS]{"a": 1',  # cut short
        'add[ARGS]{"a": 1} trailing words',
        "add[ARGS][1]",
        "",
    ],
)
def test_mistral_invalid_is_content(tail):
    text = "pre [TOOL_CALLS]" + tail
    assert MISTRAL.extract(text) == ExtractedToolCalls(text, ())


# --- streaming, examples ---


def test_streaming_content_flows_before_the_calls():
    streamer = HERMES.streamer()
    assert streamer.feed("Hello ").content == "Hello "
    assert streamer.feed("there <tool_c").content == "there "  # a partial marker is held back
    message = streamer.feed('all>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert message.content == "" and message.tool_calls == ()
    assert not streamer.called_tools
    final = streamer.finish()
    assert final.content == ""
    assert [(d.index, d.name, d.arguments) for d in final.tool_calls] == [(0, "f", '{"a": 1}')]
    assert final.tool_calls[0].id.startswith("call_")
    assert streamer.called_tools
    assert streamer.finish().tool_calls == ()  # a second finish() adds nothing
    with pytest.raises(RuntimeError):
        streamer.feed("x")


def test_streaming_partial_marker_that_is_not_one_is_content():
    streamer = HERMES.streamer()
    assert streamer.feed("a <tool_").content == "a "
    assert streamer.feed("box>").content == "<tool_box>"
    assert streamer.finish().content == ""
    assert not streamer.called_tools


def test_streaming_whitespace_before_calls_is_not_content():
    text = "\n\n" + hermes_block("f", {})
    assert stream(HERMES, list(text))[0] == ""
    assert stream(HERMES, ["\n\n"])[0] == "\n\n"  # no calls: the whitespace is the content


def test_streaming_invalid_block_turns_everything_into_content():
    text = "Hi " + hermes_block("ok", {}) + "<tool_call>{bad</tool_call>"
    content, calls, called = stream(HERMES, list(text))
    assert (content, calls, called) == (text, [], False)


def test_streaming_llama3_content_is_not_held():
    streamer = LLAMA3.streamer()
    assert streamer.feed("  ").content == ""
    assert streamer.feed("The").content == "  The"
    assert streamer.feed(" answer").content == " answer"
    assert streamer.finish().content == ""


def test_streaming_llama3_call():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": "é"}}; {"name": "g", "parameters": {}}'
    content, calls, called = stream(LLAMA3, list(text))
    assert content == "" and called
    assert [(name, arguments) for _, name, arguments in calls] == [("f", '{"a": "é"}'), ("g", "{}")]


def test_streaming_mistral_ids():
    text = 'ok[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    content, calls, _ = stream(MISTRAL, [text[i : i + 3] for i in range(0, len(text), 3)])
    assert content == "ok"
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call_id) for call_id, _, _ in calls)


# --- streaming == extract for any split (property) ---

NAMES = st.sampled_from(["get_weather", "a", "search_web", "f-1"])
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=False, allow_infinity=False), st.text()
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)
PROSE = st.text(alphabet=st.sampled_from(list("ab \n{}[];<>/_|é🙂")), max_size=12)
# Text before the calls, with the whitespace-only cases (reported as no content) drawn often.
PREFIX = st.sampled_from(["", "\n", "\n\n", " \n", "Hi", "Hi\n\n", "<"]) | PROSE


def hermes_outputs() -> st.SearchStrategy[str]:
    block = st.builds(
        lambda name, args, ascii_: (
            "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=ascii_) + "\n</tool_call>"
        ),
        NAMES,
        ARGUMENTS,
        st.booleans(),
    )
    noise = st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "call>", "{", '{"name": "f"', "\n", "x"])
    return st.builds(
        lambda pre, blocks, sep, tail: pre + sep.join(blocks) + tail,
        PREFIX,
        st.lists(block, max_size=3),
        st.sampled_from(["", "\n", " \n"]),
        st.lists(noise, max_size=2).map("".join),
    )


def llama3_outputs() -> st.SearchStrategy[str]:
    call = st.builds(
        lambda name, args, key: json.dumps({"name": name, key: args}, ensure_ascii=False),
        NAMES,
        ARGUMENTS,
        st.sampled_from(["parameters", "arguments"]),
    )
    return st.builds(
        lambda lead, tag, calls, sep, tail: lead + tag + sep.join(calls) + tail,
        st.sampled_from(["", " ", "\n"]),
        st.sampled_from(["", "<|python_tag|>", "<|python_", "<|python_tag|> "]),
        st.lists(call, max_size=3),
        st.sampled_from([";", "; ", " ;\n"]),
        st.sampled_from(["", ";", " ", "x", "{", ' {"name": 1}']),
    )


def mistral_outputs() -> st.SearchStrategy[str]:
    array = st.lists(
        st.builds(lambda name, args: {"name": name, "arguments": args}, NAMES, ARGUMENTS), min_size=1, max_size=3
    ).map(lambda calls: "[TOOL_CALLS] " + json.dumps(calls, ensure_ascii=False))
    segment = st.builds(
        lambda name, args, sep: "[TOOL_CALLS]" + name + sep + json.dumps(args, ensure_ascii=False),
        NAMES,
        ARGUMENTS,
        st.sampled_from(["[ARGS]", ""]),
    )
    return st.builds(
        lambda pre, calls, tail: pre + calls + tail,
        PREFIX,
        array | st.lists(segment, min_size=1, max_size=3).map("".join) | st.just(""),
        st.sampled_from(["", "\n", "[TOOL_", "[TOOL_CALLS]", "x", "}"]),
    )


OUTPUTS = {"hermes": hermes_outputs(), "llama3_json": llama3_outputs(), "mistral": mistral_outputs()}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_streaming_equals_extract_for_any_split(name, data):
    parser = get_tool_parser(name)
    text = data.draw(OUTPUTS[name] | PROSE, label="text")
    assert_stream_matches(parser, text, split(data, text))


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_well_formed_outputs_round_trip(name, data):
    """Outputs built from calls parse back to those calls (with nothing lost to the content)."""
    parser = get_tool_parser(name)
    calls = data.draw(st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3))
    if name == "hermes":
        text = "Intro\n" + "\n".join(hermes_block(n, a) for n, a in calls)
    elif name == "llama3_json":
        text = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    else:
        text = "Intro" + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    result = parser.extract(text)
    assert calls_of(result) == [(n, a) for n, a in calls]
    assert result.content == (None if name == "llama3_json" else "Intro" + ("\n" if name == "hermes" else ""))
    assert_stream_matches(parser, text, split(data, text))
