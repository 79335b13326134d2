"""Reading PEFT adapters: what is served is read exactly, everything else is refused naming the adapter and field."""

import json
from pathlib import Path

import pytest
import torch
from lora_helpers import make_adapter
from safetensors.torch import load_file, save_file

from pagoda.lora.adapter import LoRAAdapterError, load_adapter
from pagoda.lora.sources import LoRAModule, parse_lora_module, parse_lora_modules, read_lora_modules_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 128
# The tiny llama's wrapped layers: module -> (in_features, output slices)
TARGETS = {
    f"layers.{i}.{module}": target
    for i in range(2)
    for module, target in {
        "self_attn.qkv_proj": (HIDDEN, (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)),
        "self_attn.o_proj": (HEADS * HEAD_DIM, (HIDDEN,)),
        "mlp.gate_up_proj": (HIDDEN, (INTER, INTER)),
        "mlp.down_proj": (INTER, (HIDDEN,)),
    }.items()
}


@pytest.fixture(scope="module")
def adapter_dir(tiny, tmp_path_factory) -> Path:
    return make_adapter(tiny.get("llama"), tmp_path_factory.mktemp("adapter") / "a", rank=8, alpha=16.0)


def copy_with(adapter_dir: Path, tmp_path: Path, config: dict | None = None, tensors=None) -> Path:
    out = tmp_path / "edited"
    out.mkdir(parents=True)
    base_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**base_config, **(config or {})}))
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(out / "adapter_model.safetensors"))
    return out


def test_each_projection_becomes_a_slice_of_its_fused_layer_with_the_scaling_in_b(adapter_dir: Path) -> None:
    adapter = load_adapter("a", adapter_dir, TARGETS, max_rank=16, dtype=torch.float32)
    raw = load_file(str(adapter_dir / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1"
    a, b = adapter.weights["layers.1.self_attn.qkv_proj"][2]  # v_proj
    assert torch.equal(a, raw[f"{prefix}.self_attn.v_proj.lora_A.weight"])
    assert torch.equal(b, raw[f"{prefix}.self_attn.v_proj.lora_B.weight"] * 2.0)  # alpha 16 / r 8
    assert set(adapter.weights["layers.0.mlp.gate_up_proj"]) == {0, 1}
    assert adapter.rank == 8 and adapter.scaling == 2.0 and len(adapter.weights) == 8


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(adapter_dir: Path, tmp_path: Path) -> None:
    edited = copy_with(adapter_dir, tmp_path, {"use_rslora": True})
    assert load_adapter("a", edited, TARGETS, 16, torch.float32).scaling == pytest.approx(16 / 8**0.5)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"bias": "all"}, "only bias='none'"),
        ({"peft_type": "IA3"}, "only LORA"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 32}, "r=32 is above --max-lora-rank 16"),
        ({"r": 4}, "adapter_config.json says r=4"),
    ],
)
def test_settings_the_engine_cannot_apply_exactly_are_refused(adapter_dir, tmp_path, config, message) -> None:
    with pytest.raises(LoRAAdapterError, match="LoRA adapter 'bad'") as caught:
        load_adapter("bad", copy_with(adapter_dir, tmp_path, config), TARGETS, 16, torch.float32)
    assert message in str(caught.value)


def test_embedding_targets_missing_halves_and_foreign_shapes_are_refused(adapter_dir, tmp_path) -> None:
    def with_embedding(weights):
        return {**weights, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 256)}

    with pytest.raises(LoRAAdapterError, match="embedding or lm_head targets are not served"):
        load_adapter("bad", copy_with(adapter_dir, tmp_path / "1", tensors=with_embedding), TARGETS, 16, torch.float32)

    def without_one_b(weights):
        return {k: v for k, v in weights.items() if "layers.0.mlp.down_proj.lora_B" not in k}

    with pytest.raises(LoRAAdapterError, match="mlp.down_proj slice 0 has no lora_B"):
        load_adapter("bad", copy_with(adapter_dir, tmp_path / "2", tensors=without_one_b), TARGETS, 16, torch.float32)

    def scalar_a(weights):
        key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
        return {**weights, key: torch.tensor(1.0)}

    with pytest.raises(LoRAAdapterError, match=r"has lora_A \(\) and lora_B"):
        load_adapter("bad", copy_with(adapter_dir, tmp_path / "3", tensors=scalar_a), TARGETS, 16, torch.float32)
    wider = {name: (in_features * 2, slices) for name, (in_features, slices) in TARGETS.items()}
    with pytest.raises(LoRAAdapterError, match="trained on another base model"):
        load_adapter("bad", adapter_dir, wider, 16, torch.float32)


@pytest.mark.parametrize(
    ("config", "poison", "message"),
    [
        ({}, float("nan"), "layers.0.mlp.down_proj slice 0 has NaN or Inf in lora_A"),
        ({}, float("inf"), "layers.0.mlp.down_proj slice 0 has NaN or Inf in lora_A"),
        ({"lora_alpha": 1e308}, None, r"has NaN or Inf in lora_B scaled by 1.25e\+307"),  # finite, overflows fp32
        ({"lora_alpha": float("inf")}, None, "gives a scaling that is not finite"),
        ({"lora_alpha": float("nan")}, None, "gives a scaling that is not finite"),
    ],
)
def test_weights_or_scaling_that_are_not_finite_are_refused_at_load(adapter_dir, tmp_path, config, poison, message):
    """Loaded, such an adapter would turn every token of every request on it into NaN (a 500 each time)."""

    def poisoned(weights):
        key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
        weights[key] = weights[key].clone()
        weights[key][0, 0] = poison
        return weights

    edited = copy_with(adapter_dir, tmp_path, config, tensors=poisoned if poison is not None else None)
    with pytest.raises(LoRAAdapterError, match=message):
        load_adapter("poisoned", edited, TARGETS, 16, torch.float32)


def test_pickle_weights_are_refused_and_a_folder_without_an_adapter_is_named(adapter_dir, tmp_path) -> None:
    (tmp_path / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(LoRAAdapterError, match="only safetensors are loaded"):
        load_adapter("pickled", tmp_path, TARGETS, 16, torch.float32)
    with pytest.raises(LoRAAdapterError, match="has no adapter_config.json"):
        load_adapter("empty", tmp_path / "nothing", TARGETS, 16, torch.float32)


def test_a_truncated_weights_file_is_an_adapter_error(adapter_dir, tmp_path) -> None:
    edited = copy_with(adapter_dir, tmp_path)
    weights = edited / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(LoRAAdapterError, match="cannot read adapter_model.safetensors"):
        load_adapter("cut", edited, TARGETS, 16, torch.float32)


def test_lora_modules_take_name_equals_path_and_vllm_json() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    assert parse_lora_module('{"name": "a", "path": "org/a", "base_model_name": "b"}') == LoRAModule("a", "org/a", "b")
    with pytest.raises(ValueError, match="expected name=path"):
        parse_lora_module("just-a-path")
    with pytest.raises(ValueError, match="given more than once"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="is not valid"):
        LoRAModule("has space", "/x")


def test_the_modules_file_is_a_json_list_and_a_broken_one_says_why(tmp_path: Path) -> None:
    listing = tmp_path / "adapters.json"
    listing.write_text(json.dumps([{"name": "a", "path": "/x"}]))
    assert read_lora_modules_file(listing) == [LoRAModule("a", "/x")]
    listing.write_text("[{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        read_lora_modules_file(listing)
    listing.write_text(json.dumps([{"name": "a"}]))
    with pytest.raises(ValueError, match="needs string fields name and path"):
        read_lora_modules_file(listing)
