"""Legacy completions as OpenAI and vLLM define them, against a real `pagoda serve` and the official client: echo
logprobs over prompt and output (held to transformers' own logprobs of the same checkpoint), text offsets into the
echoed text, ``max_tokens`` 0, ``prompt_logprobs``, tokens as ids, ``allowed_token_ids`` and ``bad_words``, unknown
fields, and the server flags that shape responses."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers
from server_helpers import CHAT_TEMPLATE, start_server

pytestmark = pytest.mark.slow  # real server processes

MODEL = "stories260K"
CHECKPOINT = "/work/shared/models/stories260K"
PROMPT = "Once upon a time"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("cmpl") / "server.log"
    server = start_server("--chat-template", CHAT_TEMPLATE, "--max-model-len", "256", log_path=str(log))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    """A server with every response-shaping flag set."""
    server = start_server(
        "--chat-template",
        CHAT_TEMPLATE,
        "--max-model-len",
        "256",
        "--strict-request-fields",
        "--return-tokens-as-token-ids",
        "--max-logprobs",
        "3",
        "--enable-force-include-usage",
        "--response-role",
        "narrator",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf():
    """(transformers' model, its tokenizer) of the checkpoint the server serves."""
    model = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(CHECKPOINT)


def reference_logprobs(hf, ids: list[int]) -> list[float]:
    """transformers' logprob of each token after the first, given the ones before it."""
    model, _ = hf
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def token_ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def echoed(client, **kwargs):
    kwargs = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "echo": True, "logprobs": 2, **kwargs}
    return client.completions.create(**kwargs)


def test_echo_logprobs_cover_prompt_and_output_and_equal_transformers(client, hf):
    choice = echoed(client, max_tokens=6).choices[0]
    ids = token_ids_of(
        echoed(client, max_tokens=6, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.tokens
    )
    prompt_ids = hf[1](PROMPT).input_ids
    assert ids[: len(prompt_ids)] == prompt_ids and len(ids) == len(prompt_ids) + 6
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    expected = reference_logprobs(hf, ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected)) < TOLERANCE
    # top_logprobs: the chosen token and the 2 most likely
    assert all(
        2 <= len(top) <= 3 and max(top.values()) >= lp for top, lp in zip(lp.top_logprobs[1:], lp.token_logprobs[1:])
    )
    # text_offset points into the echoed text: the slice between two offsets is what that token adds
    assert choice.text.startswith(PROMPT)
    bounds = [*lp.text_offset, len(choice.text)]
    tokenizer = hf[1]
    for i in range(len(ids)):
        added = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)[
            len(tokenizer.decode(ids[:i], skip_special_tokens=True)) :
        ]
        assert choice.text[bounds[i] : bounds[i + 1]] == added, i


def test_streamed_echo_carries_the_prompt_logprobs_and_adds_up(client):
    whole = echoed(client, max_tokens=5).choices[0]
    chunks = [c for c in echoed(client, max_tokens=5, stream=True) if c.choices]
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == 5  # the prompt's tokens, <s> included
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in joined:
            joined[key] += getattr(chunk.choices[0].logprobs, key)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert joined["tokens"] == whole.logprobs.tokens and joined["text_offset"] == whole.logprobs.text_offset
    assert joined["token_logprobs"][1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOLERANCE)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_tokens_zero_with_echo_scores_the_prompt_only(client, hf, server):
    response = echoed(client, max_tokens=0, logprobs=1)
    (choice,) = response.choices
    prompt_ids = hf[1](PROMPT).input_ids
    assert choice.text == PROMPT and len(choice.logprobs.tokens) == len(prompt_ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(reference_logprobs(hf, prompt_ids), abs=TOLERANCE)
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(prompt_ids)
    chunks = list(echoed(client, max_tokens=0, logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == 0
    # without echo there is nothing to return: vLLM's 400
    status, _, body = server.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"


def test_prompt_logprobs_on_completions_and_chat(client, server, hf):
    messages = [{"role": "user", "content": PROMPT}]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 3}
    )
    chat_ids = server.request("POST", "/tokenize", {"messages": messages})[2]["tokens"]
    for entries, prompt_ids in (
        (response.choices[0].model_extra["prompt_logprobs"], hf[1](PROMPT).input_ids),
        (chat.model_extra["prompt_logprobs"], chat_ids),
    ):
        assert entries[0] is None and len(entries) == len(prompt_ids)
        for token_id, entry, logprob in zip(prompt_ids[1:], entries[1:], reference_logprobs(hf, prompt_ids)):
            assert 3 <= len(entry) <= 4 and set(entry[str(token_id)]) == {"logprob", "rank", "decoded_token"}
            assert abs(entry[str(token_id)]["logprob"] - logprob) < TOLERANCE
            assert sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
    status, _, body = server.request(
        "POST", "/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}
    )
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"


def test_tokens_as_token_ids_by_request_and_by_flag(client, flagged, hf):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    ids = token_ids_of([c.token for c in content])
    assert hf[1].decode(ids) == chat.choices[0].message.content.strip() or chat.choices[0].message.content in hf[
        1
    ].decode(ids)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    other = openai.OpenAI(base_url=flagged.base_url, api_key="unused", max_retries=0)
    by_flag = other.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    assert by_flag.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids]  # same prompt, same greedy tokens
    as_text = other.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": False},
    )
    assert "".join(as_text.choices[0].logprobs.tokens) == as_text.choices[0].text


def greedy_ids(client, **extra) -> list[int]:
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=14,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, **extra},
    )
    return token_ids_of(response.choices[0].logprobs.tokens)


def test_allowed_token_ids_and_bad_words_are_enforced(client, server, hf):
    tokenizer = hf[1]
    baseline = greedy_ids(client)
    allowed = sorted(set(baseline[2:8]))
    constrained = greedy_ids(client, allowed_token_ids=allowed)
    assert set(constrained) <= set(allowed) and constrained != baseline[: len(constrained)]
    # bad words: vLLM's token sequences, the word as written and mid-sentence
    words = ["girl", "Lily"]
    banned = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    banned += [tokenizer.encode(" " + w, add_special_tokens=False) for w in words]

    def contains(ids: list[int], seq: list[int]) -> bool:
        return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))

    assert any(contains(baseline, seq) for seq in banned), tokenizer.decode(baseline)  # the test can fail
    cleaned = greedy_ids(client, bad_words=words)
    assert not any(contains(cleaned, seq) for seq in banned), tokenizer.decode(cleaned)
    assert cleaned[:3] == baseline[:3]  # only what the words would have changed
    for body, param in (({"allowed_token_ids": [10**6]}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words")):
        status, _, error = server.request("POST", "/v1/completions", {"prompt": PROMPT, **body})
        assert status == 400 and error["error"]["param"] == param, error


def test_unknown_fields_are_logged_once_per_name_or_refused_when_strict(server, flagged):
    for _ in range(2):
        status, _, _ = server.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "best_of_x": 1})
        assert status == 200
    status, _, _ = server.request(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "mystery": 2}
    )
    assert status == 200
    log = server.log()
    assert log.count("'best_of_x'") == 1 and log.count("'mystery'") == 1
    assert "WARNING" in next(line for line in log.splitlines() if "best_of_x" in line)
    status, _, body = flagged.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "best_of_x": 1})
    assert status == 400 and body["error"]["param"] == "best_of_x" and "best_of_x" in body["error"]["message"]


def test_max_logprobs_forced_usage_and_response_role(flagged):
    client = openai.OpenAI(base_url=flagged.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=4)
    assert info.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 4})
    assert (
        len(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=3).choices[0].logprobs.tokens)
        == 1
    )
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert chat.choices[0].message.role == "narrator"
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True))
    assert streamed[0].choices[0].delta.role == "narrator" and streamed[-1].usage.completion_tokens == 2


def test_priority_is_taken_and_reaches_the_engine(server):
    status, _, body = server.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "priority": 0})
    assert status == 200, body
    status, _, body = server.request("POST", "/v1/completions", {"prompt": PROMPT, "priority": "high"})
    assert status == 400 and body["error"]["param"] == "priority"
    # reaches the engine: a non-zero priority needs --scheduling-policy priority (vLLM's rule), streamed or not
    for stream in (False, True):
        status, _, body = server.request("POST", "/v1/completions", {"prompt": PROMPT, "priority": 3, "stream": stream})
        assert status == 400 and body["error"]["param"] == "priority", body
