"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``) against transformers 5: logits, greedy tokens under batching, chunked
prefill, preemption and prefix caching, two tensor-parallel ranks, bf16, sliding window, and LongRoPE with a partial
rotary factor past the original context under Pagoda's per-token rule.

The tiny checkpoint (tiny_checkpoints' "phi3") has Phi-4-mini's shape of RoPE: LongRoPE on the first 12 of 16
elements of each head, original_max_position_embeddings 128 of max_position_embeddings 512 (attention factor
sqrt(1 + ln 4 / ln 128)), tied embeddings, and the published fused ``qkv_proj`` / ``gate_up_proj`` tensors.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from safetensors import safe_open
from test_models import (
    ATOL,
    DTYPES,
    PagedRunner,
    assert_tokens_are_hf_argmax,
    hf_greedy,
    hf_logits,
    hf_model,
    pagoda_model,
    random_prompt,
)
from test_tensor_parallel import GREEDY, _kv_bytes, engine, prefill_logits, prompts
from tiny_checkpoints import TinyCheckpoints, tiny_config

from pagoda.quantization.config import QuantConfig

ORIGINAL = 128  # original_max_position_embeddings of the tiny checkpoint


def test_checkpoint_holds_the_published_fused_tensors(tiny: TinyCheckpoints) -> None:
    with safe_open(str(tiny.get("phi3") / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_prefill_logits_and_greedy_decode_match_transformers(tiny: TinyCheckpoints, dtype: torch.dtype) -> None:
    model_dir = tiny.get("phi3")
    prompt = random_prompt(13, seed=1)
    ref = hf_model(model_dir, dtype)
    assert ref.model.rotary_emb.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(ORIGINAL)))
    logits = PagedRunner(pagoda_model(model_dir, dtype)).step({0: prompt})[0]
    torch.testing.assert_close(logits, hf_logits(ref, prompt), atol=ATOL[dtype], rtol=0)
    tokens = PagedRunner(pagoda_model(model_dir, dtype), seed=1).greedy(prompt, 32)
    if dtype == torch.float32:
        assert tokens == hf_greedy(ref, prompt, 32)
    else:
        assert_tokens_are_hf_argmax(ref, prompt, tokens)


def test_chunked_prefill_equals_single_prefill(tiny: TinyCheckpoints) -> None:
    model = pagoda_model(tiny.get("phi3"), torch.float32)
    prompt = random_prompt(21, seed=2)
    whole = PagedRunner(model).step({0: prompt})[0]
    chunked = PagedRunner(model, seed=3)
    first, second = chunked.step({0: prompt[:9]})[0], chunked.step({0: prompt[9:]})[0]
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-4, rtol=0)


def test_eight_prompts_on_one_and_two_ranks_give_transformers_greedy_tokens(tiny: TinyCheckpoints) -> None:
    """Batching, chunked prefill (16-token steps), preemption and prefix caching at once; rank 1 reads its q, k, v
    heads (and gate, up slices) out of the fused checkpoint tensors."""
    model_dir = tiny.get("phi3")
    batch = prompts(256)  # up to 52 prompt + 20 new tokens: within the original context
    reference = hf_model(model_dir, torch.float32)
    expected = [hf_greedy(reference, p, GREEDY.max_tokens) for p in batch]
    results: dict[int, dict[str, Any]] = {}
    for tp in (1, 2):
        kv_bytes = _kv_bytes(model_dir, tp, 40)
        with engine(
            model_dir, tp, max_num_batched_tokens=16, enable_prefix_caching=True, kv_cache_memory=kv_bytes
        ) as llm:
            results[tp] = {"logits": prefill_logits(llm, batch[2])}
            results[tp]["tokens"] = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
            stats = llm.engine.get_stats()
            assert stats.num_preemptions > 0 and stats.num_chunked_prefill_steps > 0 and stats.prefix_cache_hits > 0
    assert results[2]["tokens"] == results[1]["tokens"] == expected
    torch.testing.assert_close(results[1]["logits"], hf_logits(reference, batch[2]), atol=1e-4, rtol=0)
    assert (results[2]["logits"] - results[1]["logits"]).abs().max().item() <= 1e-5


def test_sliding_window_applies_to_every_layer_as_in_transformers(tiny: TinyCheckpoints) -> None:
    model_dir = tiny.get("phi3", sliding_window=8)
    model = pagoda_model(model_dir, torch.float32)
    assert [layer.self_attn.attn.spec.sliding_window for layer in model.model.layers] == [8, 8]
    prompt = random_prompt(20, seed=9)  # longer than the window
    ref = hf_model(model_dir, torch.float32)
    torch.testing.assert_close(PagedRunner(model).step({0: prompt})[0], hf_logits(ref, prompt), atol=1e-4, rtol=0)
    assert PagedRunner(model).greedy(prompt, 16) == hf_greedy(ref, prompt, 16)


def per_token_longrope(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented rule, written out from the tiny config: short factors before ORIGINAL, long from it on."""
    rope = tiny_config("phi3").rope_parameters
    dim = 12
    base = 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    short = 1.0 / (torch.tensor(rope["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(rope["long_factor"], dtype=torch.float32) * base)
    positions = position_ids[0]
    inv_freq = torch.where((positions >= ORIGINAL)[:, None], long[None, :], short[None, :])
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = math.sqrt(1 + math.log(512 / ORIGINAL) / math.log(ORIGINAL))
    return (emb.cos() * scale)[None], (emb.sin() * scale)[None]


def test_longrope_past_the_original_context_follows_the_per_token_rule(tiny: TinyCheckpoints) -> None:
    """Past original_max_position_embeddings transformers re-rotates the whole sequence with the long factors; the
    engine keeps each token's own table (short before the boundary, long from it on). The reference is
    transformers' Phi-3 with its rotary tables replaced by that rule."""
    model_dir = tiny.get("phi3")
    model = pagoda_model(model_dir, torch.float32)
    prompt = random_prompt(150, seed=13)  # 22 tokens past the boundary
    ours = PagedRunner(model, num_blocks=96).step({0: prompt})[0]
    ref = hf_model(model_dir, torch.float32)
    plain = hf_logits(ref, prompt)
    ref.model.rotary_emb.forward = lambda x, position_ids: per_token_longrope(position_ids)
    torch.testing.assert_close(ours, hf_logits(ref, prompt), atol=1e-4, rtol=0)
    assert (ours - plain).abs().max() > 1e-2  # transformers' whole-sequence switch is a different model there
    # Decoding across the boundary: the per-token reference recomputed from scratch gives the same tokens.
    start = random_prompt(120, seed=14)
    assert PagedRunner(model, num_blocks=96).greedy(start, 16) == hf_greedy(ref, start, 16)


def test_quantized_checkpoints_of_the_fused_projections_are_refused_by_name(tiny: TinyCheckpoints) -> None:
    model = pagoda_model(tiny.get("phi3"), torch.float32)
    model.quant_config = QuantConfig(method="awq", serialized=True, bits=4, group_size=32)
    with pytest.raises(ValueError, match="awq checkpoints of Phi3ForCausalLM are not supported.*qkv_proj"):
        model.load_weights(iter([]))


def test_a_lora_adapter_on_the_fused_projections_gives_pefts_tokens(tiny: TinyCheckpoints, tmp_path) -> None:
    """Phi-3 adapters are trained on the fused qkv_proj / gate_up_proj: one A and a B over all the slices."""
    from lora_helpers import make_adapter
    from peft import PeftModel

    from pagoda.capabilities import builtin_model_path
    from pagoda.entrypoints.llm import LLM
    from pagoda.lora import LoRARequest
    from pagoda.sampling_params import SamplingParams

    base = tiny.get("phi3")
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    adapter = make_adapter(base, tmp_path / "adapter", rank=8, seed=2, targets=targets)
    reference = PeftModel.from_pretrained(hf_model(base, torch.float32), adapter).eval()
    batch = [random_prompt(9 + i, seed=40 + i) for i in range(3)]
    expected = [hf_greedy(reference, p, 10) for p in batch]
    plain = [hf_greedy(hf_model(base, torch.float32), p, 10) for p in batch]
    assert expected != plain  # the adapter changes the output
    llm = LLM(model=str(base), tokenizer=str(builtin_model_path()), block_size=4, max_model_len=96, enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(
        batch + batch, params, use_tqdm=False, lora_request=[LoRARequest("a", 1, str(adapter))] * 3 + [None] * 3
    )
    assert [o.outputs[0].token_ids for o in outputs] == expected + plain
