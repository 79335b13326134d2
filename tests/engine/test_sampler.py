"""The sampler on crafted logits: each knob's semantics, logprobs, and batch independence."""

import math
from collections import Counter
from typing import Optional

import pytest
import torch

from pagoda.sampling_params import SamplingParams, validate_for_vocab
from pagoda.worker import logits_processing
from pagoda.worker.logits_processing import SamplingRow
from pagoda.worker.sampler import (
    NO_TOKEN_LEFT,
    NON_FINITE_LOGITS,
    Sampler,
    compute_prompt_logprobs,
)

sampler = Sampler()


def make_row(
    params: Optional[SamplingParams] = None,
    seed: int = 0,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    stop_ids: frozenset[int] = frozenset(),
) -> SamplingRow:
    params = params or SamplingParams()
    generator = None if params.greedy else torch.Generator().manual_seed(seed)
    return SamplingRow(params, generator, list(prompt), list(output), stop_ids)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None, :]


def draw_many(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 1234) -> Counter:
    """Token counts of ``n`` draws, each row with its own seeded generator."""
    rows = [make_row(params, seed=seed + i) for i in range(n)]
    return Counter(sampler(logits.expand(n, -1), rows).token_ids)


def chi_square(counts: Counter, probs: dict[int, float], n: int) -> float:
    assert set(counts) <= set(probs), f"sampled tokens outside the support: {set(counts) - set(probs)}"
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())


# --- choosing the token ---------------------------------------------------------------------


def test_greedy_takes_the_argmax_and_the_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.1, 0.5, 3.0, -1.0, 3.0], [9.0, 0.0, 0.0, 0.0, 9.5]])
    out = sampler(logits, [make_row(SamplingParams(temperature=0)), make_row(SamplingParams(temperature=0))])
    assert out.token_ids == [2, 4]
    assert out.logprobs == [None, None]


def test_the_callers_logits_are_not_modified() -> None:
    logits = torch.randn(3, 50)
    before = logits.clone()
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        top_p=0.8,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        logit_bias={3: 4.0},
    )
    rows = [make_row(params, prompt=(1, 2), output=(3, 3)), make_row(SamplingParams(temperature=0, min_tokens=2))]
    rows.append(make_row(SamplingParams(temperature=0, frequency_penalty=1.0), output=(4,)))
    rows[1].min_tokens_stop_ids = frozenset({7})
    sampler(logits, rows)
    assert torch.equal(logits, before)


def test_samples_follow_the_softmax_distribution() -> None:
    probs = [0.05, 0.1, 0.15, 0.3, 0.4]
    generator_row = make_row(SamplingParams(), seed=7)
    n = 2000
    # One generator drawing step after step, as a real request does.
    counts = Counter(sampler(logits_of(probs), [generator_row]).token_ids[0] for _ in range(n))
    assert chi_square(counts, dict(enumerate(probs)), n) < 20  # 4 degrees of freedom: p < 0.001


def test_temperature_sharpens_and_flattens_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    for temperature in (0.5, 2.0):
        expected = torch.softmax(probs.log() / temperature, dim=0).tolist()
        counts = draw_many(probs.log()[None, :], SamplingParams(temperature=temperature), n)
        assert chi_square(counts, dict(enumerate(expected)), n) < 20


def test_top_k_keeps_exactly_the_k_most_likely_tokens() -> None:
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.9, 0.0, 1.8, 1.0, -0.5]])
    counts = draw_many(logits, SamplingParams(top_k=3), 1500)
    assert set(counts) == {1, 3, 5}
    kept = torch.softmax(logits[0, [1, 3, 5]], dim=0).tolist()
    assert chi_square(counts, dict(zip([1, 3, 5], kept)), 1500) < 16


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    [(0.3, {3}), (0.65, {3, 0}), (0.75, {3, 0, 2}), (0.95, {3, 0, 2, 1})],
)
def test_top_p_keeps_the_smallest_nucleus_reaching_top_p(top_p: float, nucleus: set[int]) -> None:
    probs = [0.3, 0.1, 0.2, 0.4]  # sorted: 3 (0.4), 0 (0.3), 2 (0.2), 1 (0.1)
    counts = draw_many(logits_of(probs), SamplingParams(top_p=top_p), 1500)
    assert set(counts) == nucleus


@pytest.mark.parametrize(("min_p", "kept"), [(0.2, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p: float, kept: set[int]) -> None:
    counts = draw_many(logits_of([0.5, 0.3, 0.15, 0.05]), SamplingParams(min_p=min_p), 1500)
    assert set(counts) == kept


def test_filters_compose_and_renormalise() -> None:
    probs = [0.05, 0.25, 0.1, 0.35, 0.05, 0.2]
    # top_k=4 keeps {3, 1, 5, 2}; top_p=0.7 of those (renormalised .39/.28/.22/.11) keeps {3, 1, 5}.
    counts = draw_many(logits_of(probs), SamplingParams(top_k=4, top_p=0.7), 3000)
    expected = torch.tensor([0.35, 0.25, 0.2])
    expected = dict(zip([3, 1, 5], (expected / expected.sum()).tolist()))
    assert chi_square(counts, expected, 3000) < 14


# --- logit adjustments ----------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    rows = [
        make_row(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1, 1)),
        make_row(SamplingParams()),  # no penalty: untouched
    ]
    out = logits_processing.apply_penalties(logits.clone(), rows)
    assert torch.equal(out[0], torch.tensor([1.0, -4.0, 1.0, -1.0, 0.5]))
    assert torch.equal(out[1], logits[1])


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 5)
    row = make_row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(0, 4), output=(1, 1, 3))
    out = logits_processing.apply_penalties(logits, [row])
    # token 1: 0.5 + 2 * 0.25; token 3: 0.5 + 0.25; prompt-only tokens 0 and 4 untouched.
    assert torch.allclose(out[0], torch.tensor([0.0, -1.0, 0.0, -0.75, 0.0]))


def test_negative_presence_penalty_encourages_repeats() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    greedy = SamplingParams(temperature=0, presence_penalty=-0.5)
    assert sampler(logits, [make_row(greedy, output=(1,))]).token_ids == [1]


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    assert sampler(logits, [make_row(SamplingParams(temperature=0), output=(0,))]).token_ids == [0]
    penalised = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sampler(logits, [make_row(penalised, output=(0,))]).token_ids == [1]
    frequency = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert sampler(logits, [make_row(frequency, output=(0, 0))]).token_ids == [1]


def test_logit_bias_is_added_to_the_logits() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.5]])
    out = logits_processing.apply_logit_bias(logits.clone(), [make_row(SamplingParams(logit_bias={2: 5.0, 0: -1.0}))])
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 5.0, 0.5]]))
    greedy = SamplingParams(temperature=0, logit_bias={2: 5.0})
    assert sampler(logits, [make_row(greedy)]).token_ids == [2]
    banned = SamplingParams(logit_bias={0: -100.0, 3: -100.0})
    assert set(draw_many(logits, banned, 300)) == {1, 2}


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0, 0.0, 4.0]])
    eos_and_stop = frozenset({2, 5})
    params = SamplingParams(temperature=0, min_tokens=2)
    assert sampler(logits, [make_row(params, output=(3,), stop_ids=eos_and_stop)]).token_ids == [1]
    assert sampler(logits, [make_row(params, output=(3, 3), stop_ids=eos_and_stop)]).token_ids == [2]
    rows = [make_row(SamplingParams(min_tokens=1), seed=i, stop_ids=eos_and_stop) for i in range(300)]
    assert not {2, 5} & set(sampler(logits.expand(300, -1), rows).token_ids)


def test_penalty_counts_kept_incrementally_equal_counts_taken_afresh() -> None:
    # A sequence grows over 30 steps; the kept counts must penalise exactly as counting from scratch does.
    rng = torch.Generator().manual_seed(7)
    vocab = 40
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3)
    prompt = torch.randint(0, vocab, (25,), generator=rng).tolist()
    output: list[int] = []
    kept = logits_processing.PenaltyCounts(prompt, vocab, torch.device("cpu"), with_prompt=True)
    for _ in range(30):
        logits = torch.randn(1, vocab, generator=rng)
        incremental = SamplingRow(params, None, prompt, output, frozenset(), penalty_counts=kept)
        fresh = SamplingRow(params, None, prompt, list(output), frozenset())
        a = logits_processing.apply_penalties(logits.clone(), [incremental])
        b = logits_processing.apply_penalties(logits.clone(), [fresh])
        assert torch.equal(a, b)
        output.extend(torch.randint(0, vocab, (int(torch.randint(1, 3, (1,), generator=rng)),), generator=rng).tolist())
    assert kept.num_counted == len(output) - len(output[kept.num_counted :])
    assert int(kept.output_counts.sum()) == kept.num_counted


# --- rows that have no token ----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_every_token_masked_fails_alone(temperature: float) -> None:
    vocab = 6
    params = SamplingParams(temperature=temperature, min_tokens=2, seed=1)
    logits = torch.randn(3, vocab)
    rows = [make_row(params), make_row(params, stop_ids=frozenset(range(vocab))), make_row(params)]
    out = sampler(logits, rows)
    assert out.failed_rows == {1: NO_TOKEN_LEFT}
    assert all(0 <= t < vocab for t in out.token_ids)
    alone = sampler(logits[[0, 2]], [make_row(params), make_row(params)])  # fresh generators, same seeds
    assert [out.token_ids[0], out.token_ids[2]] == alone.token_ids  # the others are unaffected


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=3)]
)
def test_non_finite_logits_fail_their_row_and_never_give_an_out_of_range_id(bad: float, params) -> None:
    vocab = 8
    logits = torch.randn(2, vocab)
    logits[1, 3] = bad
    logits[1, 5] = bad
    out = sampler(logits, [make_row(params), make_row(params)])
    assert out.failed_rows == {1: NON_FINITE_LOGITS}
    assert all(0 <= t < vocab for t in out.token_ids)
    assert 0 not in out.failed_rows


def test_logprobs_never_hold_nan_or_infinity() -> None:
    logits = torch.tensor([[float("nan"), 1.0, 2.0], [0.0, 1.0, float("-inf")]])
    out = sampler(logits, [make_row(SamplingParams(temperature=0, logprobs=3))] * 2)
    values = [lp.logprob for entry in out.logprobs for lp in entry.values()]
    assert values and all(math.isfinite(v) for v in values)


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_those_of_the_raw_logits_with_ranks_in_the_whole_vocab() -> None:
    logits = torch.tensor([[2.0, 0.5, 3.0, -1.0, 1.0, 0.0]])
    raw = torch.log_softmax(logits[0], dim=0)
    # Temperature, penalty and bias change the choice, never the reported logprobs.
    params = SamplingParams(temperature=0.5, repetition_penalty=1.5, logit_bias={3: 100.0}, logprobs=2)
    out = sampler(logits, [make_row(params, output=(2,))])
    assert out.token_ids == [3]
    entry = out.logprobs[0]
    assert list(entry) == [3, 2, 0]  # sampled token first, then the top 2 in rank order
    assert [e.rank for e in entry.values()] == [6, 1, 2]
    for token, e in entry.items():
        assert e.logprob == pytest.approx(raw[token].item(), abs=1e-6)


def test_logprobs_of_a_sampled_token_within_the_top_k_appear_once() -> None:
    logits = torch.tensor([[2.0, 0.5, 3.0, -1.0]])
    out = sampler(logits, [make_row(SamplingParams(temperature=0, logprobs=3))])
    assert list(out.logprobs[0]) == [2, 0, 1]
    assert [e.rank for e in out.logprobs[0].values()] == [1, 2, 3]


def test_zero_logprobs_reports_only_the_sampled_token() -> None:
    logits = torch.tensor([[2.0, 0.5, 3.0, -1.0]])
    rows = [make_row(SamplingParams(temperature=0, logprobs=0)), make_row(SamplingParams(temperature=0))]
    out = sampler(logits.expand(2, -1), rows)
    assert list(out.logprobs[0]) == [2] and out.logprobs[0][2].rank == 1
    assert out.logprobs[1] is None


def test_prompt_logprobs_score_the_actual_next_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(700, 16)  # more positions than one chunk
    next_ids = torch.randint(0, 16, (700,)).tolist()
    entries = compute_prompt_logprobs(logits, next_ids, k=3)
    reference = torch.log_softmax(logits, dim=-1)
    assert len(entries) == 700
    for position in (0, 511, 512, 699):
        entry, row = entries[position], reference[position]
        token = next_ids[position]
        assert next(iter(entry)) == token
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-6)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = row.topk(3).indices.tolist()
        assert [t for t in entry if t != token] == [t for t in top if t != token]


# --- reproducibility ------------------------------------------------------------------------


def seeded_params() -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=200, top_p=0.9, min_p=0.01, repetition_penalty=1.1, seed=42)


@pytest.mark.parametrize(
    ("device", "generator_device"),
    [
        ("cpu", "cpu"),
        pytest.param("cuda", "cpu", marks=pytest.mark.gpu),
        pytest.param("cuda", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_a_seeded_row_is_independent_of_its_batch_and_position(device: str, generator_device: str) -> None:
    vocab, steps = 4096, 12
    torch.manual_seed(1)
    target_logits = torch.randn(steps, vocab, device=device) * 3
    alone_gen = torch.Generator(device=generator_device).manual_seed(42)
    batched_gen = torch.Generator(device=generator_device).manual_seed(42)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, seed=1),
        SamplingParams(top_p=0.5, seed=2),
        SamplingParams(temperature=0, presence_penalty=1.0),
        SamplingParams(top_k=3, seed=3),
        SamplingParams(min_p=0.2, logit_bias={5: 10.0}, seed=4),
        SamplingParams(frequency_penalty=-1.0, seed=5),
    ]
    alone, batched, output = [], [], [7, 8]
    for step in range(steps):
        row = SamplingRow(seeded_params(), alone_gen, [1, 2, 3], list(output), frozenset({2}))
        alone.append(sampler(target_logits[step : step + 1], [row]).token_ids[0])
        rows = [make_row(p, seed=step * 10 + i, output=(4, 4)) for i, p in enumerate(others)]
        rows.insert(5, SamplingRow(seeded_params(), batched_gen, [1, 2, 3], list(output), frozenset({2})))
        batch_logits = torch.randn(8, vocab, device=device) * 3
        batch_logits[5] = target_logits[step]
        batched.append(sampler(batch_logits, rows).token_ids[5])
        output.append(alone[-1])
    assert batched == alone


def test_the_same_seed_repeats_and_different_seeds_differ() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)

    def run(seed: int) -> list[int]:
        row = make_row(SamplingParams(seed=seed), seed=seed)
        return [sampler(logits, [row]).token_ids[0] for _ in range(30)]

    assert run(5) == run(5)
    assert run(5) != run(6)
    assert len(set(run(5))) > 10  # the generator advances between steps


def test_validate_for_vocab_rejects_out_of_range_token_ids() -> None:
    validate_for_vocab(SamplingParams(logit_bias={511: 1.0}, stop_token_ids=[0]), vocab_size=512)
    with pytest.raises(ValueError, match="logit_bias has token ids outside the vocabulary"):
        validate_for_vocab(SamplingParams(logit_bias={512: 1.0}), vocab_size=512)
    with pytest.raises(ValueError, match="stop_token_ids has token ids outside the vocabulary"):
        validate_for_vocab(SamplingParams(stop_token_ids=[600]), vocab_size=512)
