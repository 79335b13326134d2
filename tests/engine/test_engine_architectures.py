"""Every supported architecture through the whole engine (batched, paged, continuous batching)
gives transformers' greedy tokens."""

import pytest
import torch
from test_models import assert_tokens_are_hf_argmax, hf_greedy, hf_model, random_prompt

from pagoda import LLM, SamplingParams
from pagoda.config import builtin_model_path


def _llm(model_dir, **kwargs) -> LLM:
    # The tiny checkpoints carry no tokenizer; stories260K's covers their 256 ids.
    return LLM(model=str(model_dir), tokenizer=str(builtin_model_path()), block_size=4, max_model_len=128, **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_batched_engine_greedy_matches_transformers_fp32(tiny, arch):
    model_dir = tiny.get(arch, torch.float32)
    prompts = [random_prompt(length, seed) for seed, length in enumerate((5, 19, 33))]
    reference = hf_model(model_dir, torch.float32)
    expected = [hf_greedy(reference, p, 24) for p in prompts]
    outputs = _llm(model_dir).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_engine_bf16_greedy_tokens_are_transformers_argmax_on_the_same_prefix(tiny, arch):
    # batched, paged, with the engine's own bf16 kernels: see assert_tokens_are_hf_argmax
    model_dir = tiny.get(arch, torch.bfloat16)
    llm = _llm(model_dir, dtype="auto")
    assert llm.engine.dtype == torch.bfloat16
    reference = hf_model(model_dir, torch.bfloat16)
    prompts = [random_prompt(length, seed) for seed, length in enumerate((5, 19, 33))]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert len(output.outputs[0].token_ids) == 24
        assert_tokens_are_hf_argmax(reference, prompt, output.outputs[0].token_ids)


def test_generation_config_supplies_default_sampling_params(tiny):
    llm = LLM(model=str(tiny.get("qwen2")), tokenizer=str(builtin_model_path()), max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.7, 0.9)  # from the checkpoint's generation_config.json
    llm_vllm_defaults = LLM(
        model=str(tiny.get("qwen2")), tokenizer=str(builtin_model_path()), max_model_len=64, generation_config="vllm"
    )
    assert llm_vllm_defaults.get_default_sampling_params().temperature == 1.0


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import json
    import shutil

    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(builtin_model_path(), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM|Qwen3ForCausalLM.*LlamaForCausalLM"):
        LLM(model=str(model_dir))
