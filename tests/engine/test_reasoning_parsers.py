"""Reasoning parsers: the <think> rules of each model family, and streaming == non-streaming for any split."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_streaming_reasoning_is_not_held_back():
    streamer = R1.streamer()
    assert streamer.feed("<thi") == ("", "")
    assert streamer.feed("nk>Let me") == ("Let me", "")
    assert streamer.feed(" think</th") == (" think", "")
    assert streamer.feed("ink>\n\nThe answer") == ("", "\n\nThe answer")
    assert streamer.feed(" is 4.") == ("", " is 4.")
    assert streamer.finish() == ("", "")
    assert streamer.finish() == ("", "")
    with pytest.raises(RuntimeError):
        streamer.feed("x")


def test_streaming_qwen3_tagged():
    streamer = QWEN3.streamer()
    assert streamer.feed("<think>") == ("", "")
    assert streamer.feed("hmm") == ("hmm", "")
    assert streamer.feed("</think>\n") == ("", "")
    assert streamer.feed("\n") == ("", "")
    assert streamer.feed("Hi") == ("", "Hi")
    assert streamer.feed("\n") == ("", "\n")
    assert streamer.finish() == ("", "")


def test_streaming_qwen3_untagged_is_held_until_decided():
    streamer = QWEN3.streamer()
    assert streamer.feed("plan ") == ("", "")
    assert streamer.feed("more</thi") == ("", "")
    assert streamer.feed("nk>\n\nanswer") == ("plan more", "answer")
    assert streamer.finish() == ("", "")

    streamer = QWEN3.streamer()
    assert streamer.feed("Just ") == ("", "")
    assert streamer.feed("an answer.") == ("", "")
    assert streamer.finish() == ("", "Just an answer.")


def test_streaming_r1_partial_end_tag_at_finish_is_reasoning():
    streamer = R1.streamer()
    assert streamer.feed("plan</thi") == ("plan", "")
    assert streamer.finish() == ("</thi", "")


TEXT = st.lists(
    st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "\n", "\n\n", " ", "plan", "é🙂", "<", ">", "x"]),
    max_size=10,
).map("".join) | st.text(max_size=20)


def split(data: st.DataObject, text: str) -> list[str]:
    """``text`` cut at random places (sometimes one character per chunk)."""
    if data.draw(st.booleans()):
        return list(text) or [""]
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


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
