"""How one chat choice's text becomes OpenAI's assistant message, whole and streamed.

The streamed deltas, concatenated as a client does, must say what the whole message says, for every
tool choice and with the reasoning parser on or off."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.entrypoints.openai.chat_output import ChatOutputConfig
from pagoda.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagoda.entrypoints.openai.serving_chat import merge_deltas
from pagoda.entrypoints.openai.tool_parsers import get_tool_parser

HERMES = get_tool_parser("hermes")
QWEN3 = get_reasoning_parser("qwen3")
R1 = get_reasoning_parser("deepseek_r1")

CASES = [
    # (config, generated text)
    (ChatOutputConfig(), "plain answer"),
    (ChatOutputConfig(reasoning_parser=QWEN3), "<think>\nhmm\n</think>\n\nThe answer."),
    (
        ChatOutputConfig("auto", None, HERMES, QWEN3),
        '<think>plan</think>\n\nOk.\n<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>',
    ),
    (ChatOutputConfig("auto", None, HERMES), "no call here <tool_c but not a marker"),
    (ChatOutputConfig("required"), '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'),
    (ChatOutputConfig("required"), '[{"name": "f", "parame'),  # cut by max_tokens: raw text
    (ChatOutputConfig("named", "f"), '{"city": "Oslo", "days": 3}'),
    # Grammar-shaped outputs: reasoning only when the output itself opens a <think> block.
    (ChatOutputConfig("named", "f", reasoning_parser=R1, constrained=True), '{"city": "Oslo"}'),
    (ChatOutputConfig(reasoning_parser=R1, constrained=True), "<think>plan</think>answer"),
    (ChatOutputConfig(reasoning_parser=R1, constrained=True), "<thi"),
    (ChatOutputConfig(reasoning_parser=QWEN3, constrained=True), "  <think>\nplan\n</think>\n\nanswer"),
]


def _streamed(config: ChatOutputConfig, pieces: list[str]) -> dict:
    streamer = config.streamer()
    delta: dict = {}
    for piece in pieces:
        delta = merge_deltas(delta, streamer.delta(piece))
    delta = merge_deltas(delta, streamer.finish())
    calls: dict[int, dict] = {}
    for fragment in delta.get("tool_calls", []):
        call = calls.setdefault(fragment["index"], {"id": None, "name": None, "arguments": ""})
        call["id"] = call["id"] or fragment.get("id")
        call["name"] = call["name"] or fragment["function"].get("name")
        call["arguments"] += fragment["function"].get("arguments", "")
    return {
        "content": delta.get("content"),
        "reasoning_content": delta.get("reasoning_content"),
        "calls": [(c["name"], json.loads(c["arguments"])) for c in calls.values()],
        "called_tools": streamer.called_tools,
    }


def _whole(config: ChatOutputConfig, text: str) -> dict:
    message = config.message(text)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    return {
        "content": message["content"] or None,
        "reasoning_content": message.get("reasoning_content"),
        "calls": calls,
        "called_tools": bool(calls),
    }


@pytest.mark.parametrize(("config", "text"), CASES)
def test_whole_messages(config, text):
    message = config.message(text)
    assert message["role"] == "assistant"
    if message.get("tool_calls"):
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])


def test_a_grammar_shaped_output_is_not_read_as_reasoning():
    # deepseek_r1 reads text without </think> as reasoning (its template opens the block in the prompt); an
    # output a grammar wrote from its first token has none unless it opens the block itself.
    config = ChatOutputConfig(reasoning_parser=R1, constrained=True)
    assert config.message('{"a": 1}') == {"role": "assistant", "content": '{"a": 1}'}
    assert ChatOutputConfig(reasoning_parser=R1).message('{"a": 1}')["reasoning_content"] == '{"a": 1}'
    assert config.message("<think>x</think>y")["reasoning_content"] == "x"


def test_a_forced_call_is_not_content():
    message = ChatOutputConfig("named", "f").message('{"a": 1}')
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    cut = ChatOutputConfig("named", "f").message('{"a": ')
    assert cut["content"] == '{"a": ' and "tool_calls" not in cut


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streamed_deltas_reassemble_into_the_whole_message(case, cuts):
    config, text = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _streamed(config, pieces) == _whole(config, text)
