"""SamplingParams: vLLM's defaults, normalisation, and a helpful ValueError for every bad value."""

import math

import pytest

from pagoda.sampling_params import RequestOutputKind, SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.stop_strings == [] and p.stop_token_ids == []
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None and p.logit_bias is None
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert not p.greedy
    assert p.max_stop_string_len == 0
    assert p.all_stop_token_ids == frozenset()


def test_zero_temperature_is_greedy_and_drops_the_filters() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.2)
    assert p.greedy
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 1.0, 0, 0.0)


def test_tiny_temperature_counts_as_greedy() -> None:
    assert SamplingParams(temperature=1e-7).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_forms_are_normalised() -> None:
    assert SamplingParams(stop="END").stop_strings == ["END"]
    p = SamplingParams(stop=["a", "bcd"], stop_token_ids=[5, 7])
    assert p.stop_strings == ["a", "bcd"]
    assert p.max_stop_string_len == 3
    assert p.all_stop_token_ids == frozenset({5, 7})


def test_logit_bias_keys_may_be_strings() -> None:
    # JSON object keys are strings; the OpenAI API sends logit_bias that way.
    assert SamplingParams(logit_bias={"42": 3, 7: -1.5}).logit_bias == {42: 3.0, 7: -1.5}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1"),
        ({"temperature": -0.1}, "temperature must be a non-negative"),
        ({"temperature": math.inf}, "temperature must be a non-negative"),
        ({"temperature": math.nan}, "temperature must be a non-negative"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be 0 or -1"),
        ({"top_k": 2.5}, "top_k must be 0 or -1"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"presence_penalty": math.nan}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"temperature": 1e39}, "temperature must be a non-negative number of at most 100"),
        ({"temperature": 100.5}, "temperature must be a non-negative number of at most 100"),
        ({"temperature": True}, "temperature must be a non-negative"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"repetition_penalty": 1e-300}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"repetition_penalty": 1e300}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"repetition_penalty": math.nan}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"min_tokens": -1}, "min_tokens must be non-negative"),
        ({"min_tokens": 10, "max_tokens": 5}, r"min_tokens \(10\) must not exceed max_tokens \(5\)"),
        ({"logprobs": -1}, "logprobs must be non-negative"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be non-negative"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"stop": 5}, "stop must be a string or a list"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"seed": 2**64}, "seed must be an integer in"),
        ({"seed": 2**63 - 1, "n": 2}, "seed must be an integer in"),
        ({"logit_bias": {3: 150.0}}, r"logit_bias for token 3 must be in \[-100, 100\]"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias entries must map integer token ids"),
        ({"logit_bias": {-4: 1.0}}, "logit_bias token ids must be non-negative"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a mapping"),
    ],
)
def test_invalid_values_raise_a_helpful_value_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_boundary_values_are_accepted() -> None:
    SamplingParams(
        top_p=1.0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        max_tokens=None,
        min_tokens=3,
        logprobs=0,
        prompt_logprobs=0,
        logit_bias={0: -100.0, 1: 100.0},
        seed=0,
    )
    SamplingParams(temperature=100.0, repetition_penalty=0.01, seed=-(2**63))
    SamplingParams(repetition_penalty=100.0, seed=2**63 - 2)
