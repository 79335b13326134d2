"""A tiny random-weight Qwen3 chat model: tokenizer, Qwen-style chat template and all, built offline.

:func:`build_tiny_chat_qwen3` writes a directory that loads like a real Qwen3 checkpoint, for tests
of structured outputs (grammar-constrained JSON), tool calling (hermes ``<tool_call>`` format) and
reasoning (``<think>``) through the engine and the OpenAI-compatible server:

* ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``: a byte-level BPE
  tokenizer made with the ``tokenizers`` library. Its pre-tokenizer is Qwen2/3's (NFC, the Qwen
  split regex, then byte-level with no prefix space), its base vocabulary the 256 byte-level
  symbols, so any UTF-8 text encodes, plus merges trained on a small in-code corpus of JSON,
  English and digits (so multi-character tokens such as ``{"``, ``":``, ``true`` and common
  words exist). Qwen's special tokens follow the regular vocabulary in Qwen's order; the
  tool-call / think markers are added *non-special* tokens, as in real Qwen3 (so
  ``skip_special_tokens`` keeps them).
* ``config.json`` / ``model.safetensors``: :func:`tiny_checkpoints.build_tiny_checkpoint`'s
  seeded random Qwen3 with ``vocab_size == len(tokenizer)``, so every id the model can sample
  decodes.
* ``generation_config.json``: Qwen3's (eos ``[<|im_end|>, <|endoftext|>]``, temperature 0.6,
  top_p 0.95, top_k 20).

The weights are random, so what the model generates is gibberish; the point is the plumbing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_checkpoints import build_tiny_checkpoint
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

# Size of the regular (byte-level BPE) vocabulary: 256 byte symbols plus trained merges.
REGULAR_VOCAB_SIZE = 448

# Qwen2/Qwen3's pre-tokenizer split pattern (digits are split one by one).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens in the order (relative) of real Qwen3: special ones first, then the markers.
SPECIAL_TOKEN_NAMES = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKER_TOKEN_NAMES = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

# name -> id of every added token (their ids follow the regular vocabulary).
SPECIAL_TOKENS: dict[str, int] = {
    name: REGULAR_VOCAB_SIZE + i for i, name in enumerate(SPECIAL_TOKEN_NAMES + MARKER_TOKEN_NAMES)
}
VOCAB_SIZE = REGULAR_VOCAB_SIZE + len(SPECIAL_TOKENS)  # == len(tokenizer) == config.vocab_size
ENDOFTEXT_ID = SPECIAL_TOKENS["<|endoftext|>"]
IM_START_ID = SPECIAL_TOKENS["<|im_start|>"]
IM_END_ID = SPECIAL_TOKENS["<|im_end|>"]
EOS_TOKEN_IDS = [IM_END_ID, ENDOFTEXT_ID]  # generation_config.json's, as in Qwen3
MAX_POSITION_EMBEDDINGS = 2048

# Qwen3's chat template (its logic and output, transcribed; tolerant of a None system content):
# * every turn: "<|im_start|>{role}\n{content}<|im_end|>\n";
# * with tools: a first system turn "{system content}\n\n" (if messages[0] is a system message)
#   + "# Tools ... <tools>\n{tool json}\n...\n</tools>\n\nFor each function call ... <tool_call>\n
#   {"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>";
# * assistant tool calls: "\n" (unless it is the first call and there is no content) + '<tool_call>\n
#   {"name": "NAME", "arguments": ARGS}\n</tool_call>', ARGS as given if a string, else tojson;
# * consecutive "tool" messages: one user turn, each "\n<tool_response>\n{content}\n</tool_response>";
# * assistant content with "</think>": only what follows it is kept for turns up to the last user
#   query. Assistant turns after it (an agentic tool loop) keep "<think>\n{reasoning}\n</think>\n\n"
#   when they have reasoning (reasoning_content, or the content before "</think>"), and the last
#   message, if it is such an assistant turn, always gets the block (empty if no reasoning);
# * add_generation_prompt: "<|im_start|>assistant\n", plus "<think>\n\n</think>\n\n" when
#   enable_thinking is defined and false.
TINY_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' and messages[0].content is string %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + (messages[0].content if messages[0].content is string else '') + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

_JSON_SNIPPETS = (
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "search", "arguments": {"query": "the best pizza in town", "limit": 10}}',
    '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]}',
    '{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {}}}',
    '{"id": 42, "value": 3.14, "enabled": true, "deleted": false, "parent": null, "tags": ["a", "b"]}',
    '{"answer": "yes", "score": 0.95, "items": [1, 2, 3], "nested": {"key": "value", "list": []}}',
    '[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]',
    '{"result": {"temperature": 21, "condition": "sunny", "humidity": 40}, "error": null}',
    '{"done": false, "valid": false, "ok": true, "count": 0, "missing": null}',
    '{"title": "A short story", "author": "someone", "year": 2024, "pages": 128, "available": true}',
)

_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. ",
    "You may call one or more functions to assist with the user query. ",
    "For each function call, return a json object with function name and arguments. ",
    "What is the weather like today in the city? It is sunny and warm with a light wind. ",
    "Please think step by step before you answer the question. ",
    "I am a helpful assistant and I will answer your questions as well as I can. ",
    "Once upon a time there was a little girl who lived in a house near the forest. ",
    "She liked to play with her friends and to read books about animals and the sea. ",
    "Let me check the result of the tool and then give the final answer to the user. ",
)

_DIGITS = ("0 1 2 3 4 5 6 7 8 9 10 100 2024 3.14 -1 1e5 0.5 42 12345 67890",)


def _training_corpus() -> list[str]:
    """The fixed in-code corpus the BPE merges are trained on (weighted by repetition)."""
    return list(_JSON_SNIPPETS) * 4 + list(_ENGLISH) * 3 + list(_DIGITS) * 2


def build_tiny_chat_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer with Qwen's special tokens and :data:`TINY_CHAT_TEMPLATE`."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=REGULAR_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer)
    if tok.get_vocab_size() != REGULAR_VOCAB_SIZE:
        raise RuntimeError(f"the BPE corpus gave {tok.get_vocab_size()} tokens, not {REGULAR_VOCAB_SIZE}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKEN_NAMES])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKEN_NAMES])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    if ids != SPECIAL_TOKENS or len(tokenizer) != VOCAB_SIZE:
        raise RuntimeError(f"unexpected added-token ids {ids} / vocabulary size {len(tokenizer)}")
    return tokenizer


def build_tiny_chat_qwen3(out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny Qwen3 chat checkpoint (weights, configs, tokenizer, chat template) to ``out_dir``."""
    out_dir = Path(out_dir)
    # Qwen3's: <|endoftext|> begins and pads (config.json and generation_config.json say the same)
    bos_and_pad = {"bos_token_id": ENDOFTEXT_ID, "pad_token_id": ENDOFTEXT_ID}
    build_tiny_checkpoint(
        "qwen3",
        out_dir,
        torch.float32,
        seed=seed,
        vocab_size=VOCAB_SIZE,
        eos_token_id=IM_END_ID,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        **bos_and_pad,
    )
    # build_tiny_checkpoint's generation_config.json has its own ids (1 and 2): replace it with Qwen3's.
    GenerationConfig(
        eos_token_id=EOS_TOKEN_IDS,
        **bos_and_pad,
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
    ).save_pretrained(out_dir)
    build_tiny_chat_tokenizer().save_pretrained(out_dir)
    return out_dir
