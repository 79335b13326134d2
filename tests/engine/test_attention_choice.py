"""The measured choice of the CPU prefill-attention kernel (native or SDPA, which oneDNN runs on AMX tiles where
present): the decision from fake timings, the override, and both kernels giving the same attention."""

from __future__ import annotations

import pytest
import torch
from test_models import assert_tokens_are_hf_argmax, hf_model, random_prompt

from pagoda import LLM, SamplingParams
from pagoda.attention.choice import _prefill_call, choose_prefill_attention
from pagoda.attention.protocol import AttentionLayerSpec
from pagoda.attention.torch_backend import TorchAttentionBackend, native_attention_applies
from pagoda.config import builtin_model_path

SPEC = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_dim=64, scale=64**-0.5)
NATIVE = native_attention_applies(torch.empty(1, 4, 64, dtype=torch.bfloat16), SPEC)
needs_native = pytest.mark.skipif(not NATIVE, reason="the native CPU attention kernel is not built on this CPU")


def fake_timer(times: list[float]):
    """Each call returns the next time: native, sdpa, native, sdpa, ..."""
    queue = list(times)
    return lambda call: queue.pop(0)


@needs_native
@pytest.mark.parametrize(
    ("times", "chosen"),
    [
        ([1.0, 0.5, 1.0, 0.5], "sdpa"),  # clearly faster in both passes
        ([1.0, 0.5, 1.0, 1.2], "native"),  # one fast pass is noise
        ([1.0, 0.99], "native"),  # within the tolerance: keep the native kernel (no second pass)
        ([1.0, 2.0], "native"),
    ],
)
def test_sdpa_is_kept_only_when_clearly_faster_twice(monkeypatch, times, chosen):
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "auto")
    backend = TorchAttentionBackend()
    assert choose_prefill_attention(backend, SPEC, torch.bfloat16, tokens=64, timer=fake_timer(times)) == chosen
    assert backend.prefill_kernel == chosen


@needs_native
@pytest.mark.parametrize(("mode", "chosen"), [("native", "native"), ("onednn", "sdpa")])
def test_the_environment_forces_a_kernel_without_timing(monkeypatch, mode, chosen):
    monkeypatch.setenv("PAGODA_CPU_KERNELS", mode)
    backend = TorchAttentionBackend()
    assert choose_prefill_attention(backend, SPEC, torch.bfloat16, timer=fake_timer([])) == chosen


def test_float32_keeps_sdpa_for_every_step_untimed():
    backend = TorchAttentionBackend()
    assert choose_prefill_attention(backend, SPEC, torch.float32, timer=fake_timer([])) == "native"
    assert not native_attention_applies(torch.empty(1, 4, 64), SPEC)  # float32 never takes the native kernel


@needs_native
def test_both_kernels_compute_the_same_prefill_attention():
    backend = TorchAttentionBackend()
    torch.manual_seed(0)
    run = _prefill_call(backend, SPEC, torch.bfloat16, tokens=100)
    native, sdpa = run("native").float(), run("sdpa").float()
    assert backend.prefill_kernel == "native"  # the probe leaves the choice as it was
    assert torch.allclose(native, sdpa, atol=2e-2, rtol=2e-2), (native - sdpa).abs().max()


@needs_native
def test_an_engine_with_sdpa_prefill_gives_transformers_argmax_tokens(tiny, monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "onednn")
    model_dir = tiny.get("qwen3", torch.bfloat16)
    llm = LLM(model=str(model_dir), tokenizer=str(builtin_model_path()), block_size=4, max_model_len=128)
    assert llm.engine.executor.driver_worker.model_runner.attn_backend.prefill_kernel == "sdpa"
    reference = hf_model(model_dir, torch.bfloat16)
    prompts = [random_prompt(length, seed) for seed, length in enumerate((5, 19, 33))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert_tokens_are_hf_argmax(reference, prompt, output.outputs[0].token_ids)
