"""Gemma 2 and Gemma 3 (text) against transformers: logits, greedy tokens, chunking, batching, TP, LoRA, LLM.

The tiny checkpoints (see ``tiny_checkpoints``) have a sliding window of 8 that every prompt here outruns, soft caps
(Gemma 2) that bend the logits, and Gemma 3's two RoPE tables; transformers runs with eager attention (its Gemma 2
has no SDPA path, and eager applies the window and the caps in fp32 as in bf16).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_helpers import make_adapter
from peft import PeftModel
from test_models import (
    PagedRunner,
    assert_tokens_are_hf_argmax,
    hf_greedy,
    hf_logits,
    pagoda_model,
    random_prompt,
)
from test_tensor_parallel import GREEDY, _kv_bytes, engine
from tiny_checkpoints import TinyCheckpoints
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.config import builtin_model_path
from pagoda.lora import LoRARequest
from pagoda.model_config import ModelConfig

FAMILIES = ("gemma2", "gemma3")
WINDOW = 8


def hf_model(model_dir: Path, dtype: torch.dtype) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()


def prompts() -> list[list[int]]:
    """Eight prompts of 5..40 tokens: most outrun the window of 8."""
    return [random_prompt(5 + 5 * i, seed=20 + i) for i in range(8)]


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp32_prefill_logits_and_greedy_tokens_over_eight_prompts_equal_transformers(
    tiny: TinyCheckpoints, arch: str
) -> None:
    model_dir = tiny.get(arch)
    ref = hf_model(model_dir, torch.float32)
    model = pagoda_model(model_dir, torch.float32)
    long = random_prompt(30, seed=1)
    logits = PagedRunner(model).step({0: long})[0]
    torch.testing.assert_close(logits, hf_logits(ref, long), atol=1e-4, rtol=0)
    for seed, prompt in enumerate(prompts()):
        assert PagedRunner(model, seed=seed).greedy(prompt, 16) == hf_greedy(ref, prompt, 16), prompt


@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16_and_tokens_are_its_argmax(
    tiny: TinyCheckpoints, arch: str
) -> None:
    """The bf16 spec: this tiny Gemma's logits move ~0.1-0.45 between fp32 and bf16 in transformers itself (its
    eager attention rounds the scores to bf16, Pagoda's backends do not), so a fixed 0.1 would test rounding luck.
    Ours must be no further from transformers' fp32 logits than 1.5x its own bf16 ones, and every greedy token
    transformers' bf16 argmax within 4 bf16 ulps."""
    model_dir = tiny.get(arch)
    ref32, ref16 = hf_model(model_dir, torch.float32), hf_model(model_dir, torch.bfloat16)
    model = pagoda_model(model_dir, torch.bfloat16)
    prompt = random_prompt(21, seed=1)
    exact = hf_logits(ref32, prompt)
    theirs = (hf_logits(ref16, prompt) - exact).abs().max().item()
    ours = (PagedRunner(model).step({0: prompt})[0] - exact).abs().max().item()
    assert ours <= 1.5 * theirs + 0.02, (ours, theirs)
    assert_tokens_are_hf_argmax(ref16, prompt, PagedRunner(model, seed=1).greedy(prompt, 24), max_ulps=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_chunked_prefill_past_the_window_equals_one_prefill(tiny: TinyCheckpoints, arch: str, dtype) -> None:
    model = pagoda_model(tiny.get(arch), dtype)
    prompt = random_prompt(26, seed=2)
    whole = PagedRunner(model).step({0: prompt})[0]
    chunked = PagedRunner(model, seed=3)
    parts = [chunked.step({0: prompt[a:b]})[0] for a, b in ((0, 5), (5, 17), (17, 26))]  # each sees the last window
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_mixed_batch_equals_each_request_alone(tiny: TinyCheckpoints, arch: str) -> None:
    model = pagoda_model(tiny.get(arch), torch.float32)
    a, b, c = random_prompt(14, seed=6), random_prompt(6, seed=7), random_prompt(19, seed=8)
    batch = PagedRunner(model)
    batch.step({0: a[:-1]})
    mixed = batch.step({0: a[-1:], 1: b, 2: c})  # request 0 decodes while 1 and 2 prefill
    torch.testing.assert_close(mixed[0][-1], PagedRunner(model).step({0: a})[0][-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1], PagedRunner(model).step({0: b})[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[2], PagedRunner(model).step({0: c})[0], atol=1e-5, rtol=0)


def test_the_window_and_the_caps_are_where_the_config_puts_them(tiny: TinyCheckpoints) -> None:
    gemma2 = pagoda_model(tiny.get("gemma2"), torch.float32)
    specs = [layer.self_attn.attn.spec for layer in gemma2.model.layers]
    assert [s.sliding_window for s in specs] == [WINDOW, None, WINDOW]
    assert {s.logits_soft_cap for s in specs} == {10.0} and {s.scale for s in specs} == {24**-0.5}
    assert gemma2.model.rotary_emb_local is None and gemma2.params.final_logit_softcap == 5.0
    gemma3 = pagoda_model(tiny.get("gemma3"), torch.float32)
    specs = [layer.self_attn.attn.spec for layer in gemma3.model.layers]
    assert [s.sliding_window for s in specs] == [WINDOW, None, WINDOW]
    assert {s.logits_soft_cap for s in specs} == {None} and gemma3.params.final_logit_softcap is None
    assert gemma3.model.rotary_emb.scaling.factor == 8.0 and gemma3.model.rotary_emb_local.theta == 10000.0


def test_a_hub_style_gemma3_config_resolves_like_transformers(tiny: TinyCheckpoints, tmp_path: Path) -> None:
    """gemma-3-1b's config.json as published (transformers 4.5x): rope_theta + rope_local_base_freq +
    rope_scaling, sliding_window_pattern instead of layer_types, no tie_word_embeddings."""
    source = tiny.get("gemma3", num_hidden_layers=4, layer_types=["sliding_attention"] * 4)
    legacy = tmp_path / "gemma3-legacy"
    legacy.mkdir()
    for item in source.iterdir():
        (legacy / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "tie_word_embeddings", "_sliding_window_pattern"):
        config.pop(key, None)
    config |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 2}
    config["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    (legacy / "config.json").unlink()
    (legacy / "config.json").write_text(json.dumps(config))
    model = pagoda_model(legacy, torch.float32)
    assert [layer.self_attn.attn.spec.sliding_window for layer in model.model.layers] == [WINDOW, None, WINDOW, None]
    prompt = random_prompt(24, seed=3)
    ref = hf_model(legacy, torch.float32)
    assert ref.config.layer_types == ["sliding_attention", "full_attention"] * 2
    torch.testing.assert_close(PagedRunner(model).step({0: prompt})[0], hf_logits(ref, prompt), atol=1e-4, rtol=0)


def test_a_multimodal_gemma3_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34},
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration is a multimodal .* Gemma3ForCausalLM"):
        ModelConfig.from_model_dir(tmp_path)


@pytest.mark.parametrize("arch", FAMILIES)
def test_llm_on_one_and_two_ranks_gives_transformers_greedy_tokens(tiny: TinyCheckpoints, arch: str) -> None:
    """Through ``pagoda.LLM``: chunked prefill (16-token steps), prefix caching and preemption at once, tensor
    parallel over two CPU ranks equal to one rank, both equal to transformers."""
    model_dir = tiny.get(arch)
    batch = [random_prompt(12, seed=9) + p if i % 2 == 0 else p for i, p in enumerate(prompts())]
    ref = hf_model(model_dir, torch.float32)
    expected = [hf_greedy(ref, p, GREEDY.max_tokens) for p in batch]
    for tp in (1, 2):
        kv_bytes = _kv_bytes(model_dir, tp, 40)
        with engine(
            model_dir, tp, max_num_batched_tokens=16, enable_prefix_caching=True, kv_cache_memory=kv_bytes
        ) as llm:
            tokens = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
            stats = llm.engine.get_stats()
        assert tokens == expected, tp
        assert stats.num_preemptions > 0 and stats.num_chunked_prefill_steps > 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_lora_adapter_on_attention_and_mlp_gives_pefts_tokens(tiny: TinyCheckpoints, arch: str, tmp_path) -> None:
    base = tiny.get(arch)
    adapter = make_adapter(base, tmp_path / "adapter", rank=8, seed=1)
    reference = PeftModel.from_pretrained(hf_model(base, torch.float32), adapter).eval()
    batch = prompts()[:4]
    expected = [hf_greedy(reference, p, 12) for p in batch]
    plain = [hf_greedy(hf_model(base, torch.float32), p, 12) for p in batch]
    assert expected != plain  # the adapter changes the output
    llm = LLM(model=str(base), tokenizer=str(builtin_model_path()), block_size=4, max_model_len=96, enable_lora=True)
    request = LoRARequest("a", 1, str(adapter))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(batch + batch, params, use_tqdm=False, lora_request=[request] * 4 + [None] * 4)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == expected + plain
