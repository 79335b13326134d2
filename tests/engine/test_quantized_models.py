"""Quantized checkpoints (AWQ, GPTQ, FP8) and FP8 applied at load, through the whole engine.

Each format is written by :mod:`pagoda.testing.quant_writers` from a tiny random-weight checkpoint, exactly as the
published tools lay it out (the byte layouts are checked against the formats' specifications in
test_quant_formats.py). The reference is transformers' model of the float checkpoint with every quantized weight
replaced by its dequantized value: in float32, Pagoda's logits equal it within float32 rounding and its greedy tokens
are the same; in bfloat16 (the native CPU kernels) each greedy token is transformers' argmax up to bf16 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_models import assert_tokens_are_hf_argmax, hf_greedy, hf_logits, hf_model, random_prompt
from test_tensor_parallel import prefill_logits

from pagoda import LLM, SamplingParams
from pagoda.capabilities import capabilities
from pagoda.cli import build_parser
from pagoda.config import builtin_model_path
from pagoda.loader import safetensors_files
from pagoda.quantization.config import checkpoint_quant_config
from pagoda.quantization.formats import QUANT_TENSOR_SUFFIXES, build_quantized_weight
from pagoda.quantization.weights import quantize_fp8_per_row
from pagoda.testing.quant_writers import write_quantized_checkpoint

# (method, writer options): group sizes divide the tiny models' 64- and 128-wide inputs.
FORMATS = {
    "awq-g32": ("awq", dict(bits=4, group_size=32)),
    "gptq-g32-act-order": ("gptq", dict(bits=4, group_size=32, desc_act=True)),
    "gptq-8bit-asym-g64": ("gptq", dict(bits=8, group_size=64, sym=False)),
    "fp8-channel-dynamic": ("fp8", dict(fp8_weight_strategy="channel")),
    "fp8-tensor-static": ("fp8", dict(fp8_weight_strategy="tensor", fp8_static_activations=True)),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [random_prompt(length, seed) for seed, length in enumerate((5, 19, 33))]


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    """(arch, format name) -> the quantized checkpoint's directory, written once per module."""
    root = tmp_path_factory.mktemp("quantized")
    built: dict[tuple[str, str], Path] = {}

    def get(arch: str, name: str) -> Path:
        if (arch, name) not in built:
            method, options = FORMATS[name]
            built[arch, name] = write_quantized_checkpoint(
                tiny.get(arch, torch.float32), root / f"{arch}-{name}", method, **options
            )
        return built[arch, name]

    return get


def _llm(model_dir: Path, **kwargs) -> LLM:
    return LLM(model=str(model_dir), tokenizer=str(builtin_model_path()), block_size=4, max_model_len=128, **kwargs)


def dequantized_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """Checkpoint module name -> its dequantized float32 weight, read back from a quantized checkpoint."""
    config = checkpoint_quant_config(json.loads((model_dir / "config.json").read_text()))
    assert config is not None
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                module, _, suffix = name.rpartition(".")
                tensors.setdefault(module, {})[suffix] = f.get_tensor(name)
    suffixes = QUANT_TENSOR_SUFFIXES[config.method]
    return {
        module: build_quantized_weight(
            config, {s: t for s, t in parts.items() if s in suffixes}
        ).dequantize_checkpoint_order()
        for module, parts in tensors.items()
        if "weight_scale" in parts or "qweight" in parts
    }


def reference_with(model_dir: Path, weights: dict[str, torch.Tensor]):
    """transformers' float32 model of ``model_dir`` with ``weights`` (module -> weight) in place of its own."""
    model = hf_model(model_dir, torch.float32)
    with torch.no_grad():
        for module, weight in weights.items():
            target = model.get_submodule(module).weight
            assert target.shape == weight.shape, module
            target.copy_(weight)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_float32_logits_and_greedy_tokens_equal_transformers_on_the_dequantized_weights(tiny, quantized, arch, name):
    model_dir = quantized(arch, name)
    reference = reference_with(tiny.get(arch, torch.float32), dequantized_state(model_dir))
    llm = _llm(model_dir, dtype="float32")  # --quantization inferred from config.json
    method = FORMATS[name][0]
    kernels = llm.engine.executor.driver_worker.model_runner.linear_kernels
    assert sum(count for kernel, count in kernels.items() if kernel.startswith(("int4", "int8-", "fp8"))) == 8, kernels
    logits = prefill_logits(llm, PROMPTS[2])
    expected = hf_logits(reference, PROMPTS[2])
    assert (logits - expected).abs().max().item() < 2e-5 * max(1.0, expected.abs().max().item()), method
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, 24) for p in PROMPTS]


@pytest.mark.parametrize("name", ["awq-g32", "gptq-g32-act-order", "fp8-channel-dynamic"])
def test_bfloat16_greedy_tokens_are_the_dequantized_models_argmax(tiny, quantized, name):
    model_dir = quantized("qwen3", name)
    reference = reference_with(tiny.get("qwen3", torch.float32), dequantized_state(model_dir))
    llm = _llm(model_dir, dtype="bfloat16")
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output.outputs[0].token_ids) == 24
        # bf16 activations through every layer: a few bf16 ulps of the top logit, as for the unquantized engine
        assert_tokens_are_hf_argmax(reference, prompt, output.outputs[0].token_ids, max_ulps=8)


def test_fp8_applied_at_load_equals_transformers_on_per_row_fp8_weights(tiny):
    model_dir = tiny.get("llama", torch.float32)
    reference = hf_model(model_dir, torch.float32)
    with torch.no_grad():
        for module_name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and not module_name.endswith("lm_head"):
                module.weight.copy_(quantize_fp8_per_row(module.weight).dequantize())
    llm = _llm(model_dir, dtype="float32", quantization="fp8")
    logits = prefill_logits(llm, PROMPTS[2])
    expected = hf_logits(reference, PROMPTS[2])
    assert (logits - expected).abs().max().item() < 2e-5 * max(1.0, expected.abs().max().item())
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, 24) for p in PROMPTS]


def test_a_quantized_checkpoint_holds_no_dense_copy_of_its_quantized_weights(quantized):
    llm = _llm(quantized("llama", "awq-g32"), dtype="bfloat16")
    model = llm.engine.executor.driver_worker.model_runner.model
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.weight is None and linear.kernel is not None and linear.kernel.name.startswith("int4")
        assert getattr(linear, "quant_source", None) is None  # the checkpoint's packed tensors were released
    dense = sum(p.numel() for n, p in model.named_parameters() if "layers." in n and n.endswith("proj.weight"))
    assert dense == 0


@pytest.mark.parametrize(
    ("requested", "name", "message"),
    [
        ("awq", None, "not quantized"),
        ("int8", "awq-g32", "awq"),
        ("gptq", "awq-g32", "awq"),
        ("fp8", "gptq-g32-act-order", "gptq"),
    ],
)
def test_a_flag_the_checkpoint_contradicts_is_refused_before_loading(tiny, quantized, requested, name, message):
    model_dir = tiny.get("llama", torch.float32) if name is None else quantized("llama", name)
    with pytest.raises(ValueError, match=message):
        _llm(model_dir, quantization=requested)


@pytest.mark.parametrize("name", ["awq-g32", "gptq-g32-act-order", "fp8-channel-dynamic"])
def test_quantized_checkpoints_with_tensor_parallelism_are_refused_before_any_worker_starts(quantized, name):
    with pytest.raises(ValueError, match="tensor-parallel"):
        _llm(quantized("llama", name), tensor_parallel_size=2)


def test_every_quantization_the_contract_promises_on_cpu_serves_a_model(tiny, quantized):
    serve = next(a for a in build_parser()._subparsers._actions if a.choices and "serve" in a.choices).choices["serve"]
    served = capabilities(serve)["devices"]["cpu"]
    checkpoints = {"awq": "awq-g32", "gptq": "gptq-g32-act-order", "fp8": "fp8-channel-dynamic"}
    for method in served["quantization"]:
        model_dir = quantized("qwen3", checkpoints[method]) if method in checkpoints else tiny.get("qwen3")
        llm = _llm(model_dir, dtype="bfloat16", quantization=method)
        output = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert len(output.outputs[0].token_ids) == 24, method


def test_lora_adapters_on_an_awq_base_give_peft_tokens_on_the_dequantized_base(tiny, quantized, tmp_path):
    from lora_helpers import make_adapter
    from peft import PeftModel

    from pagoda.lora import LoRARequest

    base = tiny.get("llama", torch.float32)
    model_dir = quantized("llama", "awq-g32")
    adapter = make_adapter(base, tmp_path / "adapter", rank=8, seed=3)
    reference = PeftModel.from_pretrained(reference_with(base, dequantized_state(model_dir)), adapter).eval()
    llm = _llm(model_dir, dtype="float32", enable_lora=True, max_lora_rank=16)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, 24) for p in PROMPTS]


def test_checkpoint_kv_cache_scales_reach_every_attention_layer(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(tiny.get("llama", torch.float32), tmp_path / "scaled")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)  # the older single-scale name sets both
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = _llm(model_dir, dtype="float32", kv_cache_dtype="fp8_e4m3")
    layers = llm.engine.executor.driver_worker.model_runner.model.model.layers
    assert (layers[0].self_attn.attn.k_scale, layers[0].self_attn.attn.v_scale) == (0.5, 0.25)
    assert (layers[1].self_attn.attn.k_scale, layers[1].self_attn.attn.v_scale) == (2.0, 2.0)
    assert len(llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24


def _without_config_quantization(model_dir: Path, dst: Path) -> tuple[Path, dict]:
    import shutil

    shutil.copytree(model_dir, dst)
    config = json.loads((dst / "config.json").read_text())
    quantization = config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst, quantization


def test_older_exports_that_describe_their_quantization_beside_config_json_load(quantized, tmp_path):
    gptq, settings = _without_config_quantization(quantized("llama", "gptq-g32-act-order"), tmp_path / "gptq")
    settings.pop("quant_method")  # AutoGPTQ's quantize_config.json before it named the method
    (gptq / "quantize_config.json").write_text(json.dumps(settings))
    awq, settings = _without_config_quantization(quantized("llama", "awq-g32"), tmp_path / "awq")
    legacy = {"w_bit": settings["bits"], "q_group_size": settings["group_size"], "zero_point": True, "version": "GEMM"}
    (awq / "quant_config.json").write_text(json.dumps(legacy))  # AutoAWQ's own file
    for model_dir in (gptq, awq):
        kernels = _llm(model_dir, dtype="float32").engine.executor.driver_worker.model_runner.linear_kernels
        assert sum(n for k, n in kernels.items() if k.startswith("int4")) == 8, kernels


def test_symmetric_awq_without_stored_zero_points_loads_with_the_midpoint_zero(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = write_quantized_checkpoint(tiny.get("llama"), tmp_path / "sym", "awq", bits=4, group_size=32, sym=True)
    reference = reference_with(tiny.get("llama"), dequantized_state(model_dir))
    tensors = {n: t for n, t in load_file(model_dir / "model.safetensors").items() if not n.endswith(".qzeros")}
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = _llm(model_dir, dtype="float32")
    outputs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == hf_greedy(reference, PROMPTS[0], 24)


def test_quantized_layers_never_allocate_a_dense_weight_while_the_model_is_built(quantized, monkeypatch):
    import pagoda.loader

    materialized: list[str] = []
    real = pagoda.loader.materialize_linear_weights

    def spy(model, device):
        from pagoda.layers.linear import Linear

        layers = [n for n, m in model.named_modules() if isinstance(m, Linear) and m.weight is not None]
        assert all(model.get_submodule(n).weight.is_meta for n in layers)  # built without memory
        materialized.extend(layers)
        real(model, device)

    monkeypatch.setattr(pagoda.loader, "materialize_linear_weights", spy)
    _llm(quantized("llama", "awq-g32"), dtype="float32")
    assert materialized == ["lm_head"]  # the only layer the checkpoint left unquantized
