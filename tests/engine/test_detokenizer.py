"""Incremental detokenization with the stories260K tokenizer (sentencepiece, byte fallback).

Tokens are fed one at a time, as the engine does; the reference is the tokenizer's own decode.
"""

import random
from pathlib import Path

import pytest

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import get_tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "engine/src/pagoda/assets/models/stories260K"
BOS, EOS = 1, 2
FIRST_BYTE_TOKEN, LAST_BYTE_TOKEN = 3, 258  # <0x00> .. <0xFF>
# The model's greedy continuation of [BOS] (from the model's README).
REFERENCE_OUTPUT = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]
MULTI_BYTE = ["é", "ü", "日本", "🙂", "€", "ß"]


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(MODEL_DIR)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens one by one; return every intermediate output_text."""
    texts = []
    for token_id in token_ids:
        assert detok.update([token_id]) is None
        texts.append(detok.output_text)
    return texts


def test_multi_byte_characters_are_never_emitted_half_decoded(tokenizer) -> None:
    ids = encode(tokenizer, "Hello é world 日本 🙂 ok")
    assert any(FIRST_BYTE_TOKEN <= t <= LAST_BYTE_TOKEN for t in ids), "the test needs byte-fallback tokens"
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams())
    texts = stream(detok, ids)
    assert all("\ufffd" not in text for text in texts)
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True) == "Hello é world 日本 🙂 ok"


def test_model_output_text_equals_tokenizer_decode(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams())
    stream(detok, REFERENCE_OUTPUT)
    assert detok.output_text == tokenizer.decode(REFERENCE_OUTPUT, skip_special_tokens=True)
    assert detok.output_text.startswith("Once upon a time, there was a little girl")


def test_output_after_a_text_prompt_keeps_its_leading_space(tokenizer) -> None:
    prompt = [BOS] + encode(tokenizer, "Once upon")
    output = encode(tokenizer, "Once upon a time")[2:]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    stream(detok, output)
    assert detok.output_text == " a time"
    full, prefix = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
    assert detok.output_text == full[len(prefix) :]


@pytest.mark.parametrize("seed", range(20))
def test_random_token_sequences_decode_like_the_tokenizer(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < 60:
        if rng.random() < 0.25:
            ids += encode(tokenizer, rng.choice(MULTI_BYTE))[1:]  # drop the "▁" that encode prepends
        else:
            ids.append(rng.randrange(LAST_BYTE_TOKEN + 1, len(tokenizer)))
    prompt = [BOS] + [rng.randrange(LAST_BYTE_TOKEN + 1, len(tokenizer)) for _ in range(rng.randrange(8))]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    texts = stream(detok, ids)
    assert all("\ufffd" not in text for text in texts)
    full, prefix = tokenizer.decode(prompt + ids), tokenizer.decode(prompt)
    assert detok.output_text == full[len(prefix) :]
    if len(prompt) == 1:
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip_special_tokens: bool) -> None:
    prompt = [BOS] + encode(tokenizer, "Once")
    output = [407, EOS, 261, BOS, 378]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip_special_tokens))
    stream(detok, output)
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip_special_tokens)
    prefix = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == full[len(prefix) :]
    assert ("</s>" in detok.output_text) is not skip_special_tokens


# --- linear work on runs that never form a character ------------------------------------------


class CountingTokenizer:
    """The real tokenizer, counting how many token ids every decode call is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, token_ids, **kwargs) -> str:
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


def decode_work(tokenizer, output: list[int], params: SamplingParams) -> tuple[int, str]:
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [BOS], params)
    for token_id in output:
        detok.update([token_id])
    return counting.decoded, detok.output_text


@pytest.mark.parametrize(
    ("token", "params"),
    [
        (FIRST_BYTE_TOKEN + 0x80, SamplingParams()),  # <0x80>: a continuation byte with no start, never valid
        (FIRST_BYTE_TOKEN + 0xE4, SamplingParams()),  # <0xE4>: a start byte that is never continued
        (EOS, SamplingParams(skip_special_tokens=True)),  # tokens that add no text at all
    ],
)
def test_decoding_stays_linear_on_runs_that_never_complete_a_character(tokenizer, token: int, params) -> None:
    short, _ = decode_work(tokenizer, [token] * 200, params)
    long, text = decode_work(tokenizer, [token] * 2000, params)
    # Ten times the tokens, about ten times the work (a quadratic window would be about a hundred times).
    assert long < 12 * short, (short, long)
    assert long < 40 * 2000
    if token != EOS:
        assert text.count("\ufffd") >= 2000 - 8  # invalid bytes come out as U+FFFD, all but the held-back tail


def test_valid_characters_after_an_invalid_run_still_decode_whole(tokenizer) -> None:
    # (The tokenizer turns a whole run of byte tokens into U+FFFD when any of it is invalid, so the valid text
    # starts after a plain token.)
    ids = [FIRST_BYTE_TOKEN + 0x80] * 20 + encode(tokenizer, "Once 日本 🙂 ok")
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams())
    texts = stream(detok, ids)
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert detok.output_text.endswith("Once 日本 🙂 ok")
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


# --- stop strings ---------------------------------------------------------------------------


@pytest.mark.parametrize(("include", "expected"), [(False, "Once upo"), (True, "Once upon a ti")])
def test_a_stop_string_split_across_tokens_truncates_the_text(tokenizer, include: bool, expected: str) -> None:
    params = SamplingParams(stop=["n a ti"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [BOS], params)
    ids = encode(tokenizer, "Once upon a time, there")  # ▁Once ▁upon ▁a ▁time , ...
    results = [detok.update([t]) for t in ids[:4]]
    assert results == [None, None, None, "n a ti"]  # found when "▁time" completes it
    assert detok.output_text == expected
    assert detok.stop_string == "n a ti"
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_a_stop_string_inside_byte_fallback_characters(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams(stop=["本"]))
    ids = encode(tokenizer, "Hi 日本 ok")
    found = [detok.update([t]) for t in ids[: ids.index(175) + 1]]  # up to <0xAC>, the last byte of 本
    assert found[-1] == "本" and found[:-1] == [None] * (len(found) - 1)
    assert detok.output_text == "Hi 日"


def test_the_earliest_stop_string_wins(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams(stop=["me", "ti"]))
    stream(detok, encode(tokenizer, "Once upon a")[:3])
    assert detok.update([378]) == "ti"  # "▁time" completes both; "ti" starts first
    assert detok.output_text == "Once upon a "


def test_stop_strings_are_ignored_until_min_tokens(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams(stop=["upon"], min_tokens=2))
    assert [detok.update([t]) for t in [403, 407]] == [None, None]  # "upon" in token 2: too early
    assert detok.update([261]) is None  # already passed; later tokens only look at new text
    assert detok.output_text == "Once upon a"


@pytest.mark.parametrize("include", [False, True])
def test_a_final_stop_token_is_left_out_of_the_text_unless_included(tokenizer, include: bool) -> None:
    newline = encode(tokenizer, "\n")[-1]
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams(include_stop_str_in_output=include))
    detok.update([403])
    assert detok.update([newline], stop_terminated=True) is None
    assert detok.output_text == ("Once\n" if include else "Once")
    assert detok.output_token_ids == [403, newline]


# --- streaming ------------------------------------------------------------------------------


def test_streaming_holds_back_a_possible_stop_string_prefix(tokenizer) -> None:
    params = SamplingParams(stop=[", there"])  # 7 characters: hold back 6
    detok = IncrementalDetokenizer(tokenizer, [BOS], params)
    deltas, cumulative = [], []
    for token_id in encode(tokenizer, "Once upon a time, there was"):
        stop = detok.update([token_id])
        finished = stop is not None
        cumulative.append(detok.get_next_output_text(finished=finished, delta=False))
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        held_back = 0 if finished else 6
        assert cumulative[-1] == detok.output_text[: max(len(detok.output_text) - held_back, 0)]
        assert "".join(deltas) == cumulative[-1]
        if finished:
            break
    assert stop == ", there"
    assert "".join(deltas) == detok.output_text == "Once upon a time"
    assert all("," not in delta for delta in deltas)


def test_deltas_without_stop_strings_are_not_held_back(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams())
    deltas = []
    for token_id in REFERENCE_OUTPUT:
        detok.update([token_id])
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        assert "".join(deltas) == detok.output_text
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_decode_token_keeps_the_leading_space_and_shows_special_tokens(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], SamplingParams())
    assert detok.decode_token(403) == " Once"
    assert detok.decode_token(encode(tokenizer, ",")[-1]) == ","
    assert detok.decode_token(EOS) == "</s>"
