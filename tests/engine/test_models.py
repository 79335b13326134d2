"""Model code against transformers: same logits, same greedy tokens, through the paged KV cache.

Every model here runs the way the engine runs it: a flattened batch, a paged KV cache whose
block tables are scrambled (non-contiguous, out of order), prefill followed by single-token
decode steps. The reference is always transformers on the same checkpoint.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoints import ARCHES, TinyCheckpoints
from transformers import AutoModelForCausalLM

from pagoda.attention.protocol import build_metadata
from pagoda.attention.torch_backend import TorchAttentionBackend
from pagoda.loader import load_model

STORIES_DIR = Path(__file__).resolve().parents[2] / "engine/src/pagoda/assets/models/stories260K"


def readme_greedy_ids() -> list[int]:
    """The reference greedy continuation of prompt [1] listed in the checkpoint's README."""
    readme = (STORIES_DIR / "README.md").read_text()
    match = re.search(r"New token ids.*?```\n(\[[\d, ]+\])\n```", readme, re.DOTALL)
    assert match is not None, "README.md no longer lists the reference token ids"
    return json.loads(match.group(1))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Logit tolerance against transformers (and between batchings of the same model). On CPU the
# logits are in fact bit-identical to transformers; bf16 leaves room for GEMMs whose blocking
# depends on the number of tokens (a few bf16 ulps of logits around 4-8).
ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}


class PagedRunner:
    """Runs a model step by step over a paged KV cache, allocating blocks in scrambled order."""

    def __init__(self, model: Any, block_size: int = 4, num_blocks: int = 128, seed: int = 0) -> None:
        num_layers, num_kv_heads, head_dim = model.kv_cache_spec
        self.model = model
        self.block_size = block_size
        self.caches = [
            torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=model.dtype) for _ in range(num_layers)
        ]
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Feed each request's next tokens in one varlen forward; return each request's logits [n, vocab]."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for rid, tokens in chunks.items():
            start = self.lens.get(rid, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(rid, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            self.lens[rid] = end
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
        meta = build_metadata(query_lens, seq_lens, tables, self.block_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
        return list(self.model.compute_logits(hidden).split(query_lens))

    def greedy(self, prompt: list[int], max_new_tokens: int, rid: int = 0) -> list[int]:
        """Prefill the whole prompt, then decode one token at a time; argmax each step."""
        logits = self.step({rid: prompt})[0]
        out: list[int] = []
        while len(out) < max_new_tokens:
            out.append(int(logits[-1].argmax()))
            logits = self.step({rid: out[-1:]})[0]
        return out


def pagoda_model(model_dir: Path, dtype: torch.dtype) -> Any:
    return load_model(model_dir, TorchAttentionBackend(), dtype)


def hf_model(model_dir: Path, dtype: torch.dtype) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()


def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()  # [len, vocab]


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 values near x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def assert_tokens_are_hf_argmax(model: Any, prompt: list[int], tokens: list[int], max_ulps: float = 2) -> None:
    """Fed ``prompt + tokens``, transformers' top logit at every step is the token or within max_ulps bf16 ulps.

    The bf16 greedy specification: the engine's kernels round differently from transformers' (about
    one ulp), so free-running greedy texts may part at an exact or near tie; per token they agree.
    """
    logits = hf_logits(model, prompt + tokens)[len(prompt) - 1 : -1]  # [len(tokens), vocab]
    best = logits.max(dim=-1).values
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    for step, (top, ours) in enumerate(zip(best.tolist(), chosen.tolist())):
        assert top - ours <= max_ulps * bf16_ulp(top), (
            f"step {step}: token {tokens[step]} is {top - ours} below the top"
        )


def random_prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=gen).tolist()


# --- stories260K: a real trained model ------------------------------------------------------------


def test_stories260k_greedy_matches_its_reference_output() -> None:
    expected = readme_greedy_ids()
    assert len(expected) == 64
    runner = PagedRunner(pagoda_model(STORIES_DIR, torch.float32), block_size=16)
    assert runner.greedy([1], 64) == expected


def test_stories260k_prefill_logits_match_transformers() -> None:
    prompt = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396]
    ours = PagedRunner(pagoda_model(STORIES_DIR, torch.float32), block_size=16).step({0: prompt})[0]
    torch.testing.assert_close(ours, hf_logits(hf_model(STORIES_DIR, torch.float32), prompt), atol=1e-4, rtol=0)


# --- tiny random checkpoints of every supported family -------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("arch", ARCHES)
def test_prefill_logits_and_greedy_decode_match_transformers(
    tiny: TinyCheckpoints, arch: str, dtype: torch.dtype
) -> None:
    model_dir = tiny.get(arch)
    prompt = random_prompt(13, seed=1)
    ref = hf_model(model_dir, dtype)
    runner = PagedRunner(pagoda_model(model_dir, dtype))
    logits = runner.step({0: prompt})[0]
    torch.testing.assert_close(logits, hf_logits(ref, prompt), atol=ATOL[dtype], rtol=0)

    fresh = PagedRunner(pagoda_model(model_dir, dtype), seed=1)
    tokens = fresh.greedy(prompt, 32)
    if dtype == torch.float32:
        assert tokens == hf_greedy(ref, prompt, 32)
    else:
        assert_tokens_are_hf_argmax(ref, prompt, tokens)


CHUNKED_CASES = {
    "qwen2-fp32": ("qwen2", {}, torch.float32),
    "qwen2-bf16": ("qwen2", {}, torch.bfloat16),
    # The second chunk's first tokens see part of the first chunk through the window.
    "mistral-window8-fp32": ("mistral", {"sliding_window": 8}, torch.float32),
}


@pytest.mark.parametrize(("arch", "overrides", "dtype"), CHUNKED_CASES.values(), ids=CHUNKED_CASES.keys())
def test_chunked_prefill_equals_single_prefill(
    tiny: TinyCheckpoints, arch: str, overrides: dict[str, Any], dtype: torch.dtype
) -> None:
    model = pagoda_model(tiny.get(arch, **overrides), dtype)
    prompt = random_prompt(21, seed=2)
    whole = PagedRunner(model).step({0: prompt})[0]
    chunked = PagedRunner(model, seed=3)
    first = chunked.step({0: prompt[:9]})[0]
    second = chunked.step({0: prompt[9:]})[0]  # attends to the first chunk through the cache
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=ATOL[dtype], rtol=0)


def test_varlen_batch_equals_each_request_alone(tiny: TinyCheckpoints) -> None:
    model = pagoda_model(tiny.get("llama"), torch.float32)
    short, long = random_prompt(7, seed=4), random_prompt(18, seed=5)
    batch = PagedRunner(model).step({0: short, 1: long})
    torch.testing.assert_close(batch[0], PagedRunner(model).step({0: short})[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch[1], PagedRunner(model).step({0: long})[0], atol=1e-5, rtol=0)


def test_mixed_decode_and_prefill_batch_equals_each_request_alone(tiny: TinyCheckpoints) -> None:
    model = pagoda_model(tiny.get("qwen3"), torch.float32)
    a, b = random_prompt(10, seed=6), random_prompt(6, seed=7)
    batch = PagedRunner(model)
    batch.step({0: a[:-1]})
    mixed = batch.step({0: a[-1:], 1: b})  # request 0 decodes while request 1 prefills
    torch.testing.assert_close(mixed[0][-1], PagedRunner(model).step({0: a})[0][-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1], PagedRunner(model).step({0: b})[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_output_rows_keep_the_full_passs_rows_and_cache(tiny: TinyCheckpoints, dtype: torch.dtype) -> None:
    """With output_rows the last layer's output projection and MLP run on those tokens only (the sampled
    ones). Their hidden states are the full pass's, and every token's K/V still reaches the cache."""
    model = pagoda_model(tiny.get("qwen3"), dtype)
    a, b = random_prompt(9, seed=8), random_prompt(6, seed=9)
    runs = []
    for output_rows in (None, torch.tensor([8, 14])):  # each request's last token in the flat batch
        runner = PagedRunner(model)
        tables = [runner.free_blocks[-3:], runner.free_blocks[-5:-3]]
        meta = build_metadata([9, 6], [9, 6], tables, runner.block_size)
        ids, positions = torch.tensor(a + b), torch.tensor([*range(9), *range(6)])
        runs.append((model(ids, positions, runner.caches, meta, output_rows), runner.caches))
    (full, full_caches), (kept, kept_caches) = runs
    assert kept.shape == (2, full.shape[1])
    torch.testing.assert_close(kept, full[[8, 14]], atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)
    assert all(torch.equal(x, y) for x, y in zip(full_caches, kept_caches))


# --- RoPE scaling and sliding windows -------------------------------------------------------------

ROPE_SCALINGS = {
    # original_max_position_embeddings 64 puts head_dim 16's wavelengths in all three llama3 bands.
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.mark.parametrize("rope", ROPE_SCALINGS.values(), ids=ROPE_SCALINGS.keys())
def test_rope_scaling_logits_match_transformers(tiny: TinyCheckpoints, rope: dict[str, Any]) -> None:
    model_dir = tiny.get("llama", rope_parameters=rope)
    prompt = random_prompt(40, seed=8)
    ours = PagedRunner(pagoda_model(model_dir, torch.float32)).step({0: prompt})[0]
    torch.testing.assert_close(ours, hf_logits(hf_model(model_dir, torch.float32), prompt), atol=1e-4, rtol=0)


def test_mistral_sliding_window_matches_transformers(tiny: TinyCheckpoints) -> None:
    model_dir = tiny.get("mistral", sliding_window=8)
    prompt = random_prompt(20, seed=9)  # longer than the window
    ref = hf_model(model_dir, torch.float32)
    runner = PagedRunner(pagoda_model(model_dir, torch.float32))
    torch.testing.assert_close(runner.step({0: prompt})[0], hf_logits(ref, prompt), atol=1e-4, rtol=0)
    fresh = PagedRunner(pagoda_model(model_dir, torch.float32))
    assert fresh.greedy(prompt, 16) == hf_greedy(ref, prompt, 16)


def test_qwen2_sliding_window_applies_from_max_window_layers_on(tiny: TinyCheckpoints) -> None:
    model_dir = tiny.get("qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    prompt = random_prompt(20, seed=10)
    model = pagoda_model(model_dir, torch.float32)
    windows = [layer.self_attn.attn.spec.sliding_window for layer in model.model.layers]
    assert windows == [None, 6, 6]
    ours = PagedRunner(model).step({0: prompt})[0]
    torch.testing.assert_close(ours, hf_logits(hf_model(model_dir, torch.float32), prompt), atol=1e-4, rtol=0)
