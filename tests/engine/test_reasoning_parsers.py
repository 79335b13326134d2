"""Reasoning parsers: the <think> rules of each model family, and streaming == non-streaming for any split."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parser_helpers import split

from pagoda.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    get_reasoning_parser,
)

R1 = get_reasoning_parser("deepseek_r1")
QWEN3 = get_reasoning_parser("qwen3")


def stream(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    streamer = parser.streamer()
    parts = [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def assert_stream_matches(parser: ReasoningParser, text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    reasoning, content = parser.extract(text)
    assert stream(parser, chunks) == (reasoning or "", content or "")


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    for name, cls in REASONING_PARSERS.items():
        assert isinstance(get_reasoning_parser(name), cls) and cls.name == name
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("o1")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>plan</think>answer", ("plan", "answer")),
        ("<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),  # content kept verbatim
        ("plan</think>answer", ("plan", "answer")),  # <think> was in the prompt
        ("plan only, cut short", ("plan only, cut short", None)),  # never closed: all reasoning
        ("<think>plan, cut short", ("plan, cut short", None)),
        ("  \n<think>plan</think>answer", ("plan", "answer")),  # whitespace before the tag
        ("<think></think>answer", (None, "answer")),
        ("<think>plan</think>", ("plan", None)),
        ("a</think>b</think>c", ("a", "b</think>c")),  # only the first </think> ends the reasoning
        ("x<think>y</think>z", ("x<think>y", "z")),  # a later <think> is plain text
        ("", (None, None)),
        ("<think>", (None, None)),
        ("<thi", ("<thi", None)),
    ],
)
def test_deepseek_r1(text, expected):
    assert R1.extract(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "answer")),  # template newlines dropped
        ("plan</think>\n\nanswer\n", ("plan", "answer\n")),  # <think> was in the prompt
        ("Just an answer.", (None, "Just an answer.")),  # thinking disabled: no tags at all
        ("<think>plan, cut short", ("plan, cut short", None)),
        ("<think>\n\n</think>\n\nanswer", ("\n\n", "answer")),
        ("<think>plan</think>\n\n", ("plan", None)),
        ("</think>answer", (None, "answer")),
        ("a</think>\n \nb", ("a", " \nb")),  # only newlines are dropped
        ("", (None, None)),
        ("<thi", (None, "<thi")),
        ("x <think>y", (None, "x <think>y")),
    ],
)
def test_qwen3(text, expected):
    assert QWEN3.extract(text) == expected


def fed(parser: ReasoningParser, *chunks: str) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    """What ``feed`` returns for each chunk, and what ``finish`` returns after them (a second one returns nothing)."""
    streamer = parser.streamer()
    emitted = [streamer.feed(chunk) for chunk in chunks]
    rest = streamer.finish()
    assert streamer.finish() == ("", "")
    return emitted, rest


def test_streaming_reasoning_is_not_held_back():
    emitted, rest = fed(R1, "<thi", "nk>Let me", " think</th", "ink>\n\nThe answer", " is 4.")
    assert emitted == [("", ""), ("Let me", ""), (" think", ""), ("", "\n\nThe answer"), ("", " is 4.")]
    assert rest == ("", "")


def test_streaming_qwen3_tagged():
    emitted, rest = fed(QWEN3, "<think>", "hmm", "</think>\n", "\n", "Hi", "\n")
    assert emitted == [("", ""), ("hmm", ""), ("", ""), ("", ""), ("", "Hi"), ("", "\n")]
    assert rest == ("", "")


def test_streaming_qwen3_untagged_is_held_until_decided():
    assert fed(QWEN3, "plan ", "more</thi", "nk>\n\nanswer") == (
        [("", ""), ("", ""), ("plan more", "answer")],
        ("", ""),
    )
    assert fed(QWEN3, "Just ", "an answer.") == ([("", ""), ("", "")], ("", "Just an answer."))


def test_streaming_r1_partial_end_tag_at_finish_is_reasoning():
    assert fed(R1, "plan</thi") == ([("plan", "")], ("</thi", ""))


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
def test_feed_after_finish_is_an_error(parser):
    streamer = parser.streamer()
    streamer.feed("<think>plan</think>answer")
    streamer.finish()
    with pytest.raises(RuntimeError):
        streamer.feed("x")


TEXT = st.lists(
    st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "\n", "\n\n", " ", "plan", "é🙂", "<", ">", "x"]),
    max_size=10,
).map("".join) | st.text(max_size=20)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_streaming_equals_extract_for_any_split(name, data):
    parser = get_reasoning_parser(name)
    text = data.draw(TEXT, label="text")
    assert_stream_matches(parser, text, split(data, text))


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_long_stream_is_linear(name):
    """A long undecided output fed token by token is not rescanned per token (this would take minutes)."""
    parser = get_reasoning_parser(name)
    chunks = ["word "] * 200_000 + ["</think>", "\n\nanswer"]
    reasoning, content = stream(parser, chunks)
    assert len(reasoning) == 1_000_000 and content.endswith("answer")
