"""vLLM's two sampling masks in the sampler: ``allowed_token_ids`` (only these) and ``bad_words`` (the last token of
a word is banned where the output ends with the word's other tokens), and their validation."""

import pytest
import torch
import transformers

from pagoda.sampling_params import SamplingParams, resolve_bad_words, validate_for_vocab
from pagoda.worker.logits_processing import SamplingRow
from pagoda.worker.sampler import Sampler

VOCAB = 8


def row(params: SamplingParams, output: list[int]) -> SamplingRow:
    return SamplingRow(params, None, [0], list(output), frozenset())


def greedy(params: SamplingParams, output: list[int], logits: torch.Tensor) -> int:
    return Sampler()(logits.clone()[None], [row(params, output)]).token_ids[0]


def test_allowed_token_ids_keep_only_those_tokens_and_leave_other_rows_alone() -> None:
    logits = torch.arange(VOCAB, dtype=torch.float32)  # greedy would take 7
    params = SamplingParams(temperature=0, allowed_token_ids=[2, 5])
    assert greedy(params, [], logits) == 5
    batch = torch.stack([logits, logits])
    out = Sampler()(batch, [row(params, []), row(SamplingParams(temperature=0), [])])
    assert out.token_ids == [5, 7]
    sampled = {
        Sampler()(
            batch[:1].clone(),
            [
                SamplingRow(
                    SamplingParams(seed=s, allowed_token_ids=[2, 5]),
                    torch.Generator().manual_seed(s),
                    [0],
                    [],
                    frozenset(),
                )
            ],
        ).token_ids[0]
        for s in range(20)
    }
    assert sampled <= {2, 5}


def test_bad_words_ban_the_last_token_only_after_the_words_prefix() -> None:
    logits = torch.zeros(VOCAB)
    logits[3], logits[4] = 2.0, 1.0  # greedy: 3
    params = SamplingParams(temperature=0)
    params.bad_words_token_ids = [[6, 3], [4]]
    assert greedy(params, [1, 2], logits) == 3  # the output does not end with 6: 3 is allowed
    assert greedy(params, [1, 6], logits) == 0  # it does: 3 is banned, and the one-token word 4 always is
    params.bad_words_token_ids = [[6, 3], [99]]  # a token the model cannot produce is skipped, not indexed
    assert greedy(params, [6], logits) == 4


def test_bad_words_resolve_to_vllms_token_sequences() -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained("/work/shared/models/stories260K")
    params = SamplingParams(bad_words=["girl", " Lily"])
    resolve_bad_words(params, tokenizer)
    plain = tokenizer.encode("girl", add_special_tokens=False)
    assert params.bad_words_token_ids[0] == plain
    assert tokenizer.encode("Lily", add_special_tokens=False) in params.bad_words_token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": ["ok", "  "]}, "bad_words"),
    ],
)
def test_invalid_masks_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_allowed_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        validate_for_vocab(SamplingParams(allowed_token_ids=[1, VOCAB]), VOCAB)
    validate_for_vocab(SamplingParams(allowed_token_ids=[1, VOCAB - 1]), VOCAB)
