"""Checkpoint loading and config parsing: what gets read, and the errors a user sees when it can't be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import EOS_TOKEN_ID, TinyCheckpoints, session_checkpoints
from transformers import AutoConfig, Qwen2Config

from pagoda.attention.torch_backend import TorchAttentionBackend
from pagoda.loader import iterate_safetensors, load_model, safetensors_files
from pagoda.model_config import ModelConfig, RopeScaling, resolve_dtype
from pagoda.models import LlamaForCausalLM, Qwen3ForCausalLM, get_model_class, supported_architectures

STORIES_DIR = Path(__file__).resolve().parents[2] / "engine/src/pagoda/assets/models/stories260K"
SUPPORTED = sorted(
    [
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "GptOssForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    ]
)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    return session_checkpoints(tmp_path_factory)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def write_config(tmp_path: Path, config: dict[str, Any], generation: dict[str, Any] | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def llama_config(**changes: Any) -> dict[str, Any]:
    base = json.loads((STORIES_DIR / "config.json").read_text())
    return {**base, **changes}


# --- weights --------------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_identically_to_single_file(tiny: TinyCheckpoints) -> None:
    single = tiny.get("llama")
    sharded = tiny.get("llama", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 1
    a = load_model(single, TorchAttentionBackend(), torch.float32).state_dict()
    b = load_model(sharded, TorchAttentionBackend(), torch.float32).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_every_checkpoint_tensor_lands_in_its_parameter(tiny: TinyCheckpoints) -> None:
    model_dir = tiny.get("qwen2")
    ckpt = load_file(model_dir / "model.safetensors")
    model = load_model(model_dir, TorchAttentionBackend(), torch.float32)
    params = dict(model.named_parameters())
    layer = "model.layers.1"
    qkv = params[f"{layer}.self_attn.qkv_proj.weight"]
    expected_qkv = torch.cat([ckpt[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected_qkv)
    qkv_bias = params[f"{layer}.self_attn.qkv_proj.bias"]
    assert torch.equal(qkv_bias, torch.cat([ckpt[f"{layer}.self_attn.{p}_proj.bias"] for p in "qkv"]))
    gate_up = params[f"{layer}.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up, torch.cat([ckpt[f"{layer}.mlp.gate_proj.weight"], ckpt[f"{layer}.mlp.up_proj.weight"]]))
    assert f"{layer}.self_attn.o_proj.bias" not in params  # Qwen2 has no output-projection bias
    assert torch.equal(params["lm_head.weight"], ckpt["lm_head.weight"])


def test_load_weights_reports_every_parameter(tiny: TinyCheckpoints) -> None:
    model_dir = tiny.get("llama")
    config = ModelConfig.from_model_dir(model_dir)
    model = LlamaForCausalLM(config, TorchAttentionBackend(), torch.float32)
    loaded = model.load_weights(iterate_safetensors(model_dir))
    assert loaded == {name for name, _ in model.named_parameters()}


def test_tied_embeddings_share_one_tensor(tiny: TinyCheckpoints) -> None:
    model_dir = tiny.get("qwen3")  # tie_word_embeddings=True: no lm_head.weight in the file
    assert "lm_head.weight" not in dict(iterate_safetensors(model_dir))
    model = load_model(model_dir, TorchAttentionBackend(), torch.float32)
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_weights_are_cast_to_the_requested_dtype(tiny: TinyCheckpoints) -> None:
    model_dir = tiny.get("mistral")
    ckpt = load_file(model_dir / "model.safetensors")
    model = load_model(model_dir, TorchAttentionBackend(), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    norm = dict(model.named_parameters())["model.norm.weight"]
    assert torch.equal(norm, ckpt["model.norm.weight"].to(torch.bfloat16))


def test_missing_weight_is_a_value_error_naming_it(tiny: TinyCheckpoints, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny.get("llama"), tmp_path / "ckpt")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(model_dir, TorchAttentionBackend(), torch.float32)


def test_unexpected_or_misshapen_tensors_are_value_errors(tiny: TinyCheckpoints) -> None:
    model_dir = tiny.get("llama")
    model = LlamaForCausalLM(ModelConfig.from_model_dir(model_dir), TorchAttentionBackend(), torch.float32)
    weights = dict(iterate_safetensors(model_dir))
    with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj.weight"):
        model.load_weights([*weights.items(), ("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64))])
    weights["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)
    with pytest.raises(ValueError, match=r"q_proj.*shape \(64, 64\).*\(32, 64\)"):
        model.load_weights(weights.items())


def test_directory_without_safetensors_is_a_value_error(tmp_path: Path) -> None:
    write_config(tmp_path, llama_config())
    with pytest.raises(ValueError, match="no safetensors weights found"):
        load_model(tmp_path, TorchAttentionBackend(), torch.float32)


def test_unsupported_architecture_error_names_the_supported_ones(tmp_path: Path) -> None:
    model_dir = copy_checkpoint(STORIES_DIR, tmp_path / "ckpt")
    edit_json(model_dir / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model(model_dir, TorchAttentionBackend(), torch.float32)
    assert all(name in str(info.value) for name in SUPPORTED)
    assert supported_architectures() == SUPPORTED
    assert get_model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM


# --- config.json parsing ----------------------------------------------------------------------------


def test_stories260k_config() -> None:
    c = ModelConfig.from_model_dir(STORIES_DIR)
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("LlamaForCausalLM", 512, 64, 5)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (8, 4, 8, 172)
    assert (c.rms_norm_eps, c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (1e-5, 10000.0, None, 512)
    assert c.tie_word_embeddings and not (c.qkv_bias or c.o_proj_bias or c.mlp_bias)
    assert c.layer_sliding_windows == (None,) * 5 and c.sliding_window is None
    # config.json says eos 2; Pagoda's generation_config.json adds 1, which ends its stories.
    assert (c.bos_token_id, c.eos_token_ids, c.checkpoint_dtype) == (1, frozenset({1, 2}), torch.float32)
    assert c.generation_defaults == {}


def test_tiny_checkpoint_config_and_generation_defaults(tiny: TinyCheckpoints) -> None:
    c = ModelConfig.from_model_dir(tiny.get("qwen2"))
    assert c.architecture == "Qwen2ForCausalLM"
    assert (c.qkv_bias, c.o_proj_bias, c.mlp_bias) == (True, False, False)
    assert c.eos_token_ids == {EOS_TOKEN_ID}
    assert c.generation_defaults == {"temperature": 0.7, "top_p": 0.9}


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    write_config(tmp_path, llama_config(eos_token_id=2), {"eos_token_id": [1, 7], "top_k": 20})
    c = ModelConfig.from_model_dir(tmp_path)
    assert c.eos_token_ids == {1, 2, 7}
    assert c.generation_defaults == {"top_k": 20}


LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "rope_fields",
    [
        {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}},  # transformers 4
        {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING}},  # older still
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING}},  # transformers 5
    ],
    ids=["rope_scaling", "rope_scaling-type", "rope_parameters"],
)
def test_llama3_rope_config_formats_agree_with_transformers(tmp_path: Path, rope_fields: dict[str, Any]) -> None:
    config = llama_config(rope_scaling=None, rope_parameters=None, rope_theta=None, max_position_embeddings=131072)
    write_config(tmp_path, {**{k: v for k, v in config.items() if v is not None}, **rope_fields})
    c = ModelConfig.from_model_dir(tmp_path)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    hf = AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert (hf["rope_type"], hf["rope_theta"], hf["factor"]) == ("llama3", c.rope_theta, c.rope_scaling.factor)


def test_unsupported_rope_type_is_a_value_error(tmp_path: Path) -> None:
    write_config(tmp_path, llama_config(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4, "factor": 4.0}))
    with pytest.raises(ValueError, match="'mrope' is not supported.*default, linear, llama3, yarn, dynamic, longrope"):
        ModelConfig.from_model_dir(tmp_path)


@pytest.mark.parametrize(
    "fields",
    [
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        {"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 2},
        {"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"] * 2},
    ],
    ids=["max_window_layers", "disabled", "layer_types"],
)
def test_qwen2_sliding_window_layers_agree_with_transformers(tmp_path: Path, fields: dict[str, Any]) -> None:
    hf = Qwen2Config(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, **fields)
    raw = {**hf.to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    if "layer_types" not in fields:
        del raw["layer_types"]  # as in checkpoints written before transformers had layer_types
    c = ModelConfig.from_model_dir(write_config(tmp_path, raw))
    expected = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    assert c.layer_sliding_windows == expected


def test_mistral_window_applies_to_every_layer(tmp_path: Path) -> None:
    write_config(tmp_path, llama_config(architectures=["MistralForCausalLM"], sliding_window=4096))
    assert ModelConfig.from_model_dir(tmp_path).layer_sliding_windows == (4096,) * 5


def test_missing_directory_or_config_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_model_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_model_dir(tmp_path)


# --- dtype --------------------------------------------------------------------------------------------


def test_checkpoint_dtype_from_dtype_or_torch_dtype(tmp_path: Path) -> None:
    config = {k: v for k, v in llama_config().items() if k not in ("dtype", "torch_dtype")}
    write_config(tmp_path, {**config, "torch_dtype": "bfloat16"})
    assert ModelConfig.from_model_dir(tmp_path).checkpoint_dtype == torch.bfloat16
    write_config(tmp_path, {**config, "dtype": "float16"})
    assert ModelConfig.from_model_dir(tmp_path).checkpoint_dtype == torch.float16
    write_config(tmp_path, config)
    assert ModelConfig.from_model_dir(tmp_path).checkpoint_dtype == torch.float32


def test_resolve_dtype(tmp_path: Path) -> None:
    fp32 = ModelConfig.from_model_dir(STORIES_DIR)
    bf16 = ModelConfig.from_model_dir(write_config(tmp_path, llama_config(dtype="bfloat16")))
    assert resolve_dtype("auto", fp32, "cpu") == torch.float32  # a float32 checkpoint stays float32
    assert resolve_dtype("auto", bf16, "cpu") == torch.bfloat16
    assert resolve_dtype("half", fp32, "cpu") == torch.float16
    assert resolve_dtype("float", bf16, "cpu") == torch.float32
    assert resolve_dtype("BFloat16", fp32, torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'.*auto"):
        resolve_dtype("int8", fp32, "cpu")
