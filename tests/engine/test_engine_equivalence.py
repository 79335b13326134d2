"""Acceptance: the engine's greedy tokens on stories260K equal transformers' in every scheduling
mode (one at a time, all at once, under preemption, with chunked prefill, with prefix caching)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.config import builtin_model_path

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
MAX_MODEL_LEN = 256
# A shared story opening (100+ tokens) so prefix caching has something to find.
SHARED_PREFIX = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "friends. One day, she saw a big, red ball under a tree. She ran to the ball and picked it up. It was "
    "shiny and round. Lily wanted to show the ball to her mom, so she ran home as fast as she could. Her mom "
    "smiled and said,"
)
ENDINGS = [
    " Tim", " Sue", " the dog", " a bird", " the sun", " her friend", " a cat", " the sky", " mom", " dad",
    " a big tree", " the boat", " a frog", " the car", " a duck", " the toy", " a fish", " the cake",
    " a star", " the moon",
]  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path())
    ids = [tokenizer.encode(SHARED_PREFIX + ending) for ending in ENDINGS]
    assert len({tuple(p) for p in ids}) == 20
    assert min(len(p) for p in ids) > 100
    return ids


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    """transformers greedy generate, one prompt at a time, stopping on the model's EOS ids."""
    model = AutoModelForCausalLM.from_pretrained(builtin_model_path(), dtype=torch.float32)
    outputs = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def generate(llm: LLM, prompts: list[list[int]], one_at_a_time: bool = False) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    if one_at_a_time:
        return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_one_at_a_time_matches_transformers(prompts, reference):
    llm = LLM(max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    assert generate(llm, prompts, one_at_a_time=True) == reference


def test_all_at_once_matches_transformers(prompts, reference):
    llm = LLM(max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    assert generate(llm, prompts) == reference
    assert llm.engine.get_stats().num_preemptions == 0


def test_under_preemption_matches_transformers(prompts, reference):
    # 24 blocks of 16 tokens: one max-length sequence fits, twenty do not.
    bytes_per_block = 2 * 5 * 16 * 4 * 8 * 4
    llm = LLM(max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, kv_cache_memory=24 * bytes_per_block)
    assert llm.engine.get_stats().num_blocks == 24
    assert generate(llm, prompts) == reference
    assert llm.engine.get_stats().num_preemptions > 0


def test_with_chunked_prefill_matches_transformers(prompts, reference):
    llm = LLM(max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, max_num_batched_tokens=32)
    assert generate(llm, prompts) == reference
    assert llm.engine.get_stats().num_chunked_prefill_steps > 0


def test_with_prefix_caching_matches_transformers(prompts, reference):
    llm = LLM(max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True)
    assert generate(llm, prompts) == reference
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0
    # Every prompt after the first can reuse the full blocks of the shared prefix.
    shared_blocks = 100 // 16
    assert stats.prefix_cache_hits >= 19 * shared_blocks * 16


def test_preemption_chunking_and_prefix_caching_together_match_transformers(prompts, reference):
    bytes_per_block = 2 * 5 * 16 * 4 * 8 * 4
    llm = LLM(
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        kv_cache_memory=24 * bytes_per_block,
        max_num_batched_tokens=64,
    )
    assert generate(llm, prompts) == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.num_chunked_prefill_steps > 0
