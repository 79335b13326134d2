"""Mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE) against transformers 5 on tiny random checkpoints.

The checkpoints are what transformers' ``save_pretrained`` writes: the published per-expert layout
(``mlp.experts.{e}.gate_proj`` / Mixtral's ``block_sparse_moe.experts.{e}.w1``). Through the paged runner: prefill
logits, greedy tokens over eight prompts, chunked prefill and batching; through the whole engine (``LLM``, one and
two tensor-parallel ranks): batching, chunked prefill, prefix caching and preemption at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models import (
    ATOL,
    PagedRunner,
    assert_tokens_are_hf_argmax,
    hf_greedy,
    hf_logits,
    hf_model,
    pagoda_model,
    random_prompt,
)
from test_quantized_models import dequantized_state
from test_tensor_parallel import GREEDY, _kv_bytes, engine, prefill_logits, prompts

from pagoda.lora.adapter import LoRAAdapterError, load_adapter
from pagoda.lora.slots import LoRASlots
from pagoda.testing.quant_writers import write_quantized_checkpoint

MOE_ARCHES = ("qwen3_moe", "mixtral", "qwen2_moe")
PROMPTS = [random_prompt(4 + 3 * i, seed=10 + i) for i in range(8)]


@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_float32_prefill_logits_and_greedy_tokens_equal_transformers(tiny, arch: str) -> None:
    model_dir = tiny.get(arch)
    reference = hf_model(model_dir, torch.float32)
    model = pagoda_model(model_dir, torch.float32)
    logits = PagedRunner(model).step({0: PROMPTS[7]})[0]
    torch.testing.assert_close(logits, hf_logits(reference, PROMPTS[7]), atol=1e-4, rtol=0)
    for i, prompt in enumerate(PROMPTS):
        assert PagedRunner(model, seed=i).greedy(prompt, 8) == hf_greedy(reference, prompt, 8), i


@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_bfloat16_greedy_tokens_are_transformers_argmax(tiny, arch: str) -> None:
    model_dir = tiny.get(arch)
    reference = hf_model(model_dir, torch.bfloat16)
    runner = PagedRunner(pagoda_model(model_dir, torch.bfloat16))
    torch.testing.assert_close(
        runner.step({0: PROMPTS[5]})[0], hf_logits(reference, PROMPTS[5]), atol=ATOL[torch.bfloat16], rtol=0
    )
    tokens = PagedRunner(pagoda_model(model_dir, torch.bfloat16), seed=2).greedy(PROMPTS[3], 16)
    assert_tokens_are_hf_argmax(reference, PROMPTS[3], tokens)


@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_chunked_prefill_and_a_batch_equal_single_requests(tiny, arch: str) -> None:
    model = pagoda_model(tiny.get(arch), torch.float32)
    prompt, other = random_prompt(21, seed=2), random_prompt(9, seed=3)
    whole = PagedRunner(model).step({0: prompt})[0]
    chunked = PagedRunner(model, seed=3)
    first = chunked.step({0: prompt[:9]})[0]
    second = chunked.step({0: prompt[9:]})[0]
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=0)
    batch = PagedRunner(model, seed=4).step({0: prompt, 1: other})
    torch.testing.assert_close(batch[0], whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(batch[1], PagedRunner(model).step({0: other})[0], atol=1e-5, rtol=0)


def test_sparse_and_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step(tiny) -> None:
    qwen3 = pagoda_model(tiny.get("qwen3_moe"), torch.float32)
    assert [hasattr(layer.mlp, "experts") for layer in qwen3.model.layers] == [True, False, True]
    qwen2 = pagoda_model(tiny.get("qwen2_moe"), torch.float32)
    assert [hasattr(layer.mlp, "experts") for layer in qwen2.model.layers] == [False, True]
    assert qwen2.model.layers[1].mlp.shared_expert is not None


@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_engine_on_one_and_two_ranks_gives_transformers_greedy_tokens(tiny, arch: str) -> None:
    # chunked prefill (16-token steps), preemption (40 blocks for 8 sequences of up to 61 tokens), prefix caching
    model_dir = tiny.get(arch, torch.float32)
    batch = prompts(256)
    reference = hf_model(model_dir, torch.float32)
    expected = [hf_greedy(reference, p, GREEDY.max_tokens) for p in batch]
    results = {}
    for tp in (1, 2) if arch == "qwen3_moe" else (2,):  # one rank of every family runs in the tests above
        kv_bytes = _kv_bytes(model_dir, tp, 40)
        with engine(
            model_dir, tp, max_num_batched_tokens=16, enable_prefix_caching=True, kv_cache_memory=kv_bytes
        ) as llm:
            logits = prefill_logits(llm, batch[2])
            tokens = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
            stats = llm.engine.get_stats()
            assert stats.num_preemptions > 0 and stats.num_chunked_prefill_steps > 0 and stats.prefix_cache_hits > 0
        results[tp] = (logits, tokens)
    assert results[2][1] == expected
    if 1 in results:
        assert results[1][1] == expected
        assert (results[1][0] - results[2][0]).abs().max().item() <= 1e-5


def _reference_checkpoint(src: Path, weights: dict[str, torch.Tensor], dst: Path) -> Path:
    """A copy of the float checkpoint ``src`` with ``weights`` (module -> weight) in place of its own."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for module, weight in weights.items():
        assert tensors[f"{module}.weight"].shape == weight.shape, module
        tensors[f"{module}.weight"] = weight.to(tensors[f"{module}.weight"].dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("method", "options"), [("awq", {"group_size": 32}), ("fp8", {})], ids=["awq-g32", "fp8"])
def test_quantized_experts_equal_transformers_on_the_dequantized_weights(tiny, tmp_path, method, options) -> None:
    from test_quantized_models import _llm

    src = tiny.get("qwen3_moe", torch.float32)
    model_dir = write_quantized_checkpoint(src, tmp_path / "q", method, **options)
    dequantized = dequantized_state(model_dir)
    assert any(".experts.5.down_proj" in module for module in dequantized)
    reference = hf_model(_reference_checkpoint(src, dequantized, tmp_path / "ref"), torch.float32)
    llm = _llm(model_dir, dtype="float32")
    kernels = llm.engine.executor.driver_worker.model_runner.linear_kernels
    # 2 MoE layers x 8 experts x (gate_up, down) + 3 layers x (qkv, o) + the dense layer's (gate_up, down)
    assert sum(n for kernel, n in kernels.items() if kernel.startswith(("int4", "fp8"))) == 32 + 6 + 2, kernels
    logits = prefill_logits(llm, PROMPTS[6])
    expected = hf_logits(reference, PROMPTS[6])
    assert (logits - expected).abs().max().item() < 2e-5 * max(1.0, expected.abs().max().item())
    outputs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS[:4]
    ]


def test_a_quantized_mixtral_checkpoint_loads_its_hub_named_experts(tiny, tmp_path) -> None:
    """Mixtral's Hub names (block_sparse_moe.experts.{e}.w1/w3/w2) hold the quantized tensors of the experts."""
    from test_quantized_models import _llm

    src = tiny.get("mixtral", torch.float32, intermediate_size=64)  # AWQ groups of 32 along every input
    model_dir = write_quantized_checkpoint(src, tmp_path / "q", "awq", group_size=32)
    dequantized = dequantized_state(model_dir)
    assert any(".block_sparse_moe.experts.3.w2" in module for module in dequantized)
    reference = hf_model(_reference_checkpoint(src, dequantized, tmp_path / "ref"), torch.float32)
    llm = _llm(model_dir, dtype="float32")
    kernels = llm.engine.executor.driver_worker.model_runner.linear_kernels
    quantized = sum(n for kernel, n in kernels.items() if kernel.startswith("int4"))
    num_layers = len(llm.engine.executor.driver_worker.model_runner.model.model.layers)
    assert quantized == num_layers * (4 * 2 + 2), kernels  # every expert's gate_up and down, and qkv and o
    outputs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS[:4]
    ]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantizing_at_load_keeps_the_routers_dense(tiny, quantization) -> None:
    """The router's logits pick the experts: quantizing it would move tokens to other experts (checkpoints, vLLM and
    transformers all keep it dense), so --quantization int8 / fp8 quantizes everything around it but not it."""
    from test_quantized_models import _llm

    llm = _llm(tiny.get("qwen2_moe", torch.bfloat16), dtype="bfloat16", quantization=quantization)
    model = llm.engine.executor.driver_worker.model_runner.model
    routers = [m for name, m in model.named_modules() if name.endswith(("mlp.gate", "mlp.shared_expert_gate"))]
    experts = [m for name, m in model.named_modules() if name.endswith("experts.0.down_proj")]
    assert routers and experts
    assert all(quantization in getattr(r.kernel, "name", "dense") for r in experts)
    assert not any(quantization in getattr(r.kernel, "name", "dense") for r in routers)


def test_lora_on_attention_gives_peft_tokens(tiny, tmp_path) -> None:
    from lora_helpers import make_adapter, peft_greedy, peft_model
    from test_quantized_models import _llm

    from pagoda.lora import LoRARequest

    base = tiny.get("qwen3_moe", torch.float32)
    # PEFT on transformers 5 rewrites gate/up targets of an MoE model onto the fused expert tensors, so the
    # adapter here targets attention only (the dense layer's MLP is wrapped too: see the refusal test's targets).
    adapter = make_adapter(base, tmp_path / "adapter", rank=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    reference = peft_model(base, adapter)
    llm = _llm(base, dtype="float32", enable_lora=True, max_lora_rank=8)
    outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outputs] == [
        peft_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS[:3]
    ]


def test_an_adapter_on_expert_projections_is_refused_naming_the_module(tiny, tmp_path) -> None:
    from lora_helpers import make_adapter

    base = tiny.get("qwen3_moe", torch.float32)
    adapter = make_adapter(base, tmp_path / "adapter", rank=4, targets=["q_proj"])
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    expert = "base_model.model.model.layers.0.mlp.experts.3.gate_proj"
    tensors[f"{expert}.lora_A.weight"] = torch.zeros(4, 64)
    tensors[f"{expert}.lora_B.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4
    slots = LoRASlots(pagoda_model(base, torch.float32), 1, 8, torch.float32, torch.device("cpu"))
    assert "layers.0.mlp.gate_up_proj" not in slots.targets and "layers.1.mlp.gate_up_proj" in slots.targets
    with pytest.raises(LoRAAdapterError, match=r"mlp\.experts\.3\.gate_proj"):
        load_adapter("experts", adapter, slots.targets, 8, torch.float32)
