"""The tiny Qwen3 chat fixture: its tokenizer, chat template and config agree, and the engine runs it."""

import json

import pytest
import torch
from tiny_chat_model import (
    ENDOFTEXT_ID,
    EOS_TOKEN_IDS,
    IM_END_ID,
    IM_START_ID,
    SPECIAL_TOKENS,
    TINY_CHAT_TEMPLATE,
    VOCAB_SIZE,
    build_tiny_chat_tokenizer,
)
from transformers import AutoTokenizer

from pagoda import LLM, SamplingParams

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER_TOOL)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_qwen3):
    return AutoTokenizer.from_pretrained(tiny_chat_qwen3, local_files_only=True)


@pytest.fixture(scope="module")
def config(tiny_chat_qwen3) -> dict:
    return json.loads((tiny_chat_qwen3 / "config.json").read_text())


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# --- the checkpoint's files -------------------------------------------------------------------


def test_the_directory_holds_a_whole_checkpoint(tiny_chat_qwen3):
    names = {p.name for p in tiny_chat_qwen3.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "chat_template.jinja"} <= names


def test_vocab_size_is_the_tokenizers_and_ids_match_qwen3s(tokenizer, config, tiny_chat_qwen3):
    assert len(tokenizer) == config["vocab_size"] == VOCAB_SIZE
    assert (config["eos_token_id"], config["bos_token_id"]) == (IM_END_ID, ENDOFTEXT_ID)
    generation = json.loads((tiny_chat_qwen3 / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_TOKEN_IDS == [IM_END_ID, ENDOFTEXT_ID]
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", IM_END_ID)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", ENDOFTEXT_ID)
    assert tokenizer.chat_template == TINY_CHAT_TEMPLATE


def test_the_tokenizer_is_built_deterministically():
    first, second = build_tiny_chat_tokenizer(), build_tiny_chat_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


# --- the tokenizer ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox.",
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "ok": true, "x": null}}',
        "naïve café, Straße, 日本語のテキスト, Ελληνικά, עברית",
        "emoji 😀👍🏽 and 🇫🇷 flags, zero\u200bwidth",
        "  leading spaces\n\ttabs\r\nand newlines  ",
        "1234567890 -3.14e10",
    ],
)
def test_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_merges_make_multi_character_tokens(tokenizer):
    tokens = tokenizer.tokenize('{"name": "get_weather", "arguments": {"ok": true}}')
    assert {'{"', '":', "Ġtrue"} <= set(tokens)
    assert len(tokens) < len('{"name": "get_weather", "arguments": {"ok": true}}') / 2
    vocab = tokenizer.get_vocab()
    assert sum(len(t) > 1 for t in vocab) > 150


@pytest.mark.parametrize("name", sorted(SPECIAL_TOKENS))
def test_special_and_marker_tokens_encode_as_single_ids(tokenizer, name):
    assert tokenizer.encode(name, add_special_tokens=False) == [SPECIAL_TOKENS[name]]
    assert tokenizer.encode(f"a{name}b", add_special_tokens=False)[1] == SPECIAL_TOKENS[name]
    assert tokenizer.decode([SPECIAL_TOKENS[name]]) == name


def test_only_qwens_special_tokens_are_skipped_when_decoding(tokenizer):
    ids = tokenizer.encode("<|im_start|><think>\nhm\n</think>\n\n<tool_call>x</tool_call><|im_end|>")
    assert ids[0] == IM_START_ID
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nhm\n</think>\n\n<tool_call>x</tool_call>"


# --- the chat template ------------------------------------------------------------------------


def test_plain_chat(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        render(tokenizer, messages[:2]) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_tools_are_listed_in_the_system_prompt(tokenizer):
    user = {"role": "user", "content": "Weather in Paris?"}
    tail = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert render(tokenizer, [user], tools=[WEATHER_TOOL], add_generation_prompt=True) == (
        "<|im_start|>system\n" + TOOLS_PROMPT + tail
    )
    system = {"role": "system", "content": "Be brief."}
    assert render(tokenizer, [system, user], tools=[WEATHER_TOOL], add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_PROMPT + tail
    )


def test_assistant_tool_calls_with_string_and_object_arguments(tokenizer):
    calls = [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln"}}},
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "21C"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
    )
    messages[1]["content"] = "Let me look."
    assert "<|im_start|>assistant\nLet me look.\n<tool_call>\n" in render(tokenizer, messages)


def test_a_final_assistant_turn_after_the_last_query_gets_a_think_block_as_in_qwen3(tokenizer):
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert render(tokenizer, messages).endswith(
        '<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
    )
    messages[1] = {"role": "assistant", "content": "<think>\nplan\n</think>\n\nDone."}
    assert render(tokenizer, messages).endswith("<|im_start|>assistant\n<think>\nplan\n</think>\n\nDone.<|im_end|>\n")


def test_consecutive_tool_messages_are_one_user_turn(tokenizer):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "a", "content": "21C"},
        {"role": "tool", "tool_call_id": "b", "content": '{"temp": 19}'},
    ]
    assert render(tokenizer, messages, add_generation_prompt=True).endswith(
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n21C\n</tool_response>\n"
        '<tool_response>\n{"temp": 19}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )


def test_past_reasoning_is_dropped_and_enable_thinking_false_closes_the_think_block(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nThe user greets.\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ]
    body = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    assert render(tokenizer, messages, add_generation_prompt=True) == body + "<|im_start|>assistant\n"
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=True) == (
        body + "<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False) == (
        body + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


# --- the engine and xgrammar ------------------------------------------------------------------


def test_the_engine_loads_it_and_generates_decodable_text(tiny_chat_qwen3):
    llm = LLM(model=str(tiny_chat_qwen3), device="cpu", max_model_len=512, block_size=16, kv_cache_memory="1MiB")
    tokenizer = llm.get_tokenizer()
    assert len(tokenizer) == VOCAB_SIZE
    assert llm.engine.model_config.eos_token_ids == frozenset(EOS_TOKEN_IDS)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (output,) = llm.generate('{"name": "', greedy, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.token_ids) == 8
    assert all(0 <= i < VOCAB_SIZE for i in completion.token_ids)
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    (chat,) = llm.chat(messages, greedy, use_tqdm=False)
    prompt = render(tokenizer, messages, add_generation_prompt=True)
    assert chat.prompt_token_ids == tokenizer.encode(prompt, add_special_tokens=False)
    assert chat.prompt_token_ids[0] == IM_START_ID and len(chat.outputs[0].token_ids) == 8


def test_xgrammar_compiles_the_json_grammar_for_it(tokenizer, config):
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config["vocab_size"], stop_token_ids=[IM_END_ID])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert info.vocab_size == VOCAB_SIZE
    assert info.stop_token_ids == [IM_END_ID]
    compiled = xgr.GrammarCompiler(info).compile_builtin_json_grammar()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, VOCAB_SIZE)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    allowed = set(torch.nonzero(logits[0] == 0).flatten().tolist())
    assert tokenizer.convert_tokens_to_ids('{"') in allowed
    assert IM_END_ID not in allowed and tokenizer.convert_tokens_to_ids("a") not in allowed


def test_offline_chat_passes_tools_and_template_kwargs(tiny_chat_qwen3) -> None:
    from tiny_chat_model import build_tiny_chat_tokenizer

    from pagoda import LLM, SamplingParams

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    llm = LLM(str(tiny_chat_qwen3), device="cpu", max_model_len=512, kv_cache_memory="1MiB")
    (out,) = llm.chat(
        messages, SamplingParams(max_tokens=1), tools=tools, chat_template_kwargs={"enable_thinking": False}
    )
    expected = build_tiny_chat_tokenizer().apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
