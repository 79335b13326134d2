"""gpt-oss against transformers: attention sinks, alternating sliding-window (8 here) and full layers, YaRN RoPE,
top-k-then-softmax routing and the clamped SwiGLU experts, dense and MXFP4 as published; and the MXFP4 format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpt_oss_checkpoints import build_gpt_oss_checkpoint, build_gpt_oss_mxfp4_checkpoint
from test_models import PagedRunner, hf_greedy, hf_logits, pagoda_model, random_prompt
from test_tensor_parallel import GREEDY, _kv_bytes, engine, prefill_logits, prompts
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagoda.layers.linear_kernels import prepare_linear_layers
from pagoda.model_config import ModelConfig
from pagoda.quantization.config import checkpoint_quant_config, resolve_quant_config
from pagoda.quantization.mxfp4 import Mxfp4Config, dequantize_mxfp4, mxfp4_int_weight

PROMPT_LENGTHS = (9, 12, 15, 18, 21, 24, 27, 30)  # all past the window of 8


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "dense")


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_gpt_oss_mxfp4_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def reference(model_dir: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # eager: the sinks


def prepared(model_dir: Path) -> torch.nn.Module:
    """The model as the engine runs it on the CPU: each linear layer's kernel built (MXFP4 experts: 8-bit groups)."""
    model = pagoda_model(model_dir, torch.float32)
    prepare_linear_layers(model, torch.device("cpu"), torch.float32, None)
    return model


def test_config_has_alternating_windows_and_the_family_fields(dense: Path) -> None:
    config = ModelConfig.from_model_dir(dense)
    assert config.layer_sliding_windows == (8, None, 8)
    assert (config.qkv_bias, config.o_proj_bias, config.mlp_bias) == (True, True, False)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn"


def test_prefill_logits_and_greedy_over_eight_prompts_match_transformers(dense: Path) -> None:
    ref = reference(dense)
    model = pagoda_model(dense, torch.float32)
    for i, length in enumerate(PROMPT_LENGTHS):
        prompt = random_prompt(length, seed=10 + i)
        logits = PagedRunner(model, seed=i).step({0: prompt})[0]
        torch.testing.assert_close(logits, hf_logits(ref, prompt), atol=1e-4, rtol=0)
        assert PagedRunner(model, seed=i).greedy(prompt, 12) == hf_greedy(ref, prompt, 12), f"prompt {i}"


def test_chunked_prefill_equals_single_prefill(dense: Path) -> None:
    model = pagoda_model(dense, torch.float32)
    prompt = random_prompt(25, seed=3)
    whole = PagedRunner(model).step({0: prompt})[0]
    chunked = PagedRunner(model, seed=5)
    parts = [chunked.step({0: prompt[a:b]})[0] for a, b in ((0, 6), (6, 17), (17, 25))]  # windows span chunks
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=0)


def test_mxfp4_checkpoint_matches_transformers_on_the_dequantized_weights(mxfp4: tuple[Path, Path]) -> None:
    quantized, dequantized = mxfp4
    ref = reference(dequantized)
    model = prepared(quantized)
    experts = model.model.layers[0].mlp.experts.experts
    assert experts[0].gate_up_proj.weight is None and experts[0].down_proj.kernel is not None  # never dense
    for i, length in enumerate(PROMPT_LENGTHS[1::3]):
        prompt = random_prompt(length, seed=20 + i)
        logits = PagedRunner(model, seed=i).step({0: prompt})[0]
        torch.testing.assert_close(logits, hf_logits(ref, prompt), atol=1e-4, rtol=0)
        assert PagedRunner(model, seed=i).greedy(prompt, 8) == hf_greedy(ref, prompt, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mxfp4_dequantization_is_bit_equal_to_transformers(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 64, 4, 16), generator=gen, dtype=torch.uint8)  # every code
    scales = torch.randint(0, 256, (3, 64, 4), generator=gen, dtype=torch.uint8)  # every exponent, inf included
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)  # [E, in, out] -> [E, out, in]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(ours.view(bits), theirs.contiguous().view(bits))


def test_mxfp4_as_8_bit_groups_is_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (96, 3, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(90, 140, (96, 3), generator=gen, dtype=torch.uint8)
    weight = mxfp4_int_weight(blocks, scales)
    assert (weight.bits, weight.group_size, weight.qweight.shape) == (8, 32, (96, 96))
    assert torch.equal(weight.dequantize(), dequantize_mxfp4(blocks, scales))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), dequantize_mxfp4(blocks, scales))


def test_mxfp4_is_accepted_for_gpt_oss_only_and_flags_stay_checked() -> None:
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    gpt_oss = {"architectures": ["GptOssForCausalLM"], "quantization_config": qc}
    assert checkpoint_quant_config(gpt_oss) is None  # the model class reads the blocks and scales
    assert resolve_quant_config("int8", gpt_oss).method == "int8"  # the other layers quantized at load
    with pytest.raises(ValueError, match="experts are MXFP4"):
        resolve_quant_config("awq", gpt_oss)
    with pytest.raises(ValueError, match="MXFP4 experts are served for GptOssForCausalLM"):
        checkpoint_quant_config({"architectures": ["LlamaForCausalLM"], "quantization_config": qc})
    config = Mxfp4Config.from_raw(gpt_oss)
    assert config is not None and config.converts("model.layers.3.mlp.experts")
    assert not config.converts("model.layers.11.self_attn") and not config.converts("lm_head")


@pytest.mark.parametrize("variant", ["dense", "mxfp4"])
def test_two_ranks_through_llm_equal_one_rank_and_transformers(
    variant: str, dense: Path, mxfp4: tuple[Path, Path]
) -> None:
    model_dir, reference_dir = (dense, dense) if variant == "dense" else mxfp4
    batch = prompts(256)[:4]
    ref = reference(reference_dir)
    expected = [hf_greedy(ref, p, GREEDY.max_tokens) for p in batch]
    results = {}
    for tp in (1, 2):
        # chunked prefill (16-token steps) and preemption (24 blocks for 4 sequences of up to 47 tokens)
        kv_bytes = _kv_bytes(model_dir, tp, 24)
        # float32 (the MXFP4 checkpoint says bfloat16): the comparison is exact-weights, not bf16 rounding
        with engine(model_dir, tp, dtype="float32", max_num_batched_tokens=16, kv_cache_memory=kv_bytes) as llm:
            logits = prefill_logits(llm, batch[2])
            outputs = llm.generate(batch, GREEDY, use_tqdm=False)
            results[tp] = (logits, [o.outputs[0].token_ids for o in outputs])
    assert results[2][1] == results[1][1] == expected
    assert (results[2][0] - results[1][0]).abs().max().item() <= 1e-5


def test_a_tensor_parallel_size_that_splits_mxfp4_groups_is_refused_before_any_rank_starts(mxfp4) -> None:
    from pagoda.config import EngineArgs
    from pagoda.engine.engine_config import resolve_engine_config

    model_dir, _ = mxfp4  # experts 64 wide: 32 per rank at TP=2, 16 at TP=4
    assert resolve_engine_config(EngineArgs(model=str(model_dir), tensor_parallel_size=2, max_model_len=64))
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 splits gpt-oss's MXFP4 experts"):
        resolve_engine_config(EngineArgs(model=str(model_dir), tensor_parallel_size=4, max_model_len=64))
    config = resolve_engine_config(EngineArgs(model=str(model_dir), max_model_len=64))
    assert config.quantized_experts  # so a GPU would run its decode steps eagerly
