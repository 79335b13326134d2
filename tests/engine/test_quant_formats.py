"""Checkpoint quantization formats: config.json parsing, the converters to the canonical weight forms, and the
writers that produce AWQ / GPTQ / compressed-tensors FP8 checkpoints.

Every written checkpoint is read back two ways: by the engine's converters (``build_quantized_weight``) and by a
reference dequantization written here straight from each format's published layout (bit operations on the stored
int32 tensors, ``g_idx`` looked up per input), and the two must agree exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quant_config import GPTQ_MODEL_V2

from pagoda.quantization.config import QuantConfig, checkpoint_quant_config
from pagoda.quantization.formats import (
    QUANT_TENSOR_SUFFIXES,
    build_quantized_weight,
    fp8_weight_from_checkpoint,
    int_weight_from_gptq,
    is_quantized_module,
)
from pagoda.quantization.weights import Fp8Weight, IntWeight
from pagoda.testing.quant_writers import write_quantized_checkpoint

# hidden 128, intermediate 256, 4 heads x 32: every projection's input divides by group size 128.
SHAPES = dict(hidden_size=128, intermediate_size=256, head_dim=32)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# ---------------------------------------------------------------------------------------------------------------
# Reference dequantization, straight from each format's layout


def ref_unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight [in*bits/32, out] -> [in, out]: input k lives in row k // p at bit offset bits * (k % p)."""
    per = 32 // bits
    out = torch.empty(packed.shape[0] * per, packed.shape[1], dtype=torch.int64)
    for j in range(per):
        out[j::per] = (packed.long() >> (bits * j)) & ((1 << bits) - 1)
    return out


def ref_unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...]) -> torch.Tensor:
    """[rows, n*bits/32] -> [rows, n]: slot j of word c holds column c * p + order[j]."""
    per = 32 // bits
    out = torch.empty(packed.shape[0], packed.shape[1] * per, dtype=torch.int64)
    for j in range(per):
        out[:, order[j] :: per] = (packed.long() >> (bits * j)) & ((1 << bits) - 1)
    return out


def ref_dequant_awq(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    q = ref_unpack_cols(t["qweight"], 4, (0, 2, 4, 6, 1, 3, 5, 7))  # [in, out]
    z = ref_unpack_cols(t["qzeros"], 4, (0, 2, 4, 6, 1, 3, 5, 7))  # [G, out]
    group = torch.arange(q.shape[0]) // (q.shape[0] if group_size == -1 else group_size)
    return ((q.float() - z[group].float()) * t["scales"].float()[group]).t()


def ref_dequant_gptq(t: dict[str, torch.Tensor], bits: int, zero_offset: int) -> torch.Tensor:
    q = ref_unpack_rows(t["qweight"], bits)  # [in, out]
    z = (ref_unpack_cols(t["qzeros"], bits, tuple(range(32 // bits))) + zero_offset) % (1 << bits)  # [G, out]
    group = t["g_idx"].long()  # the group of every input, in checkpoint order
    return ((q.float() - z[group].float()) * t["scales"].float()[group]).t()


def ref_group_scale_of_each_element(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    if "g_idx" in t:  # GPTQ
        group = t["g_idx"].long()
    else:  # AWQ: qweight is [in, out/8]
        in_features = t["qweight"].shape[0]
        group = torch.arange(in_features) // (in_features if group_size == -1 else group_size)
    return t["scales"].float()[group].t()  # [out, in]


# ---------------------------------------------------------------------------------------------------------------
# Written checkpoints, read back


def load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def module_tensors(state: dict[str, torch.Tensor], method: str, module: str) -> dict[str, torch.Tensor]:
    return {s: state[f"{module}.{s}"] for s in QUANT_TENSOR_SUFFIXES[method] if f"{module}.{s}" in state}


def target_modules(source: dict[str, torch.Tensor]) -> list[str]:
    return [n[: -len(".weight")] for n in source if any(n.endswith(f"{p}.weight") for p in PROJECTIONS)]


_WRITTEN: dict[str, Path] = {}


@pytest.fixture(scope="module")
def source(tiny) -> Path:
    return tiny.get("llama", torch.float32, **SHAPES)


@pytest.fixture(scope="module")
def write(source: Path, tmp_path_factory: pytest.TempPathFactory):
    """write(method, **options) -> the written checkpoint (each distinct one written once per module)."""

    def get(method: str, src: Optional[Path] = None, **options: Any) -> Path:
        key = json.dumps([method, str(src), options], sort_keys=True)
        if key not in _WRITTEN:
            dst = tmp_path_factory.mktemp(f"{method}-quantized")
            _WRITTEN[key] = write_quantized_checkpoint(src or source, dst, method, **options)
        return _WRITTEN[key]

    return get


INT_CASES = [
    ("awq", dict(group_size=32)),
    ("awq", dict(group_size=64)),
    ("awq", dict(group_size=128)),
    ("awq", dict(group_size=64, sym=True)),
    ("gptq", dict(bits=4, group_size=128)),
    ("gptq", dict(bits=4, group_size=64, sym=False)),
    ("gptq", dict(bits=8, group_size=128)),
    ("gptq", dict(bits=4, group_size=32, desc_act=True)),
    ("gptq", dict(bits=8, group_size=64, desc_act=True, sym=False)),
    ("gptq", dict(bits=4, group_size=-1)),
]


@pytest.mark.parametrize("method, options", INT_CASES, ids=lambda v: v if isinstance(v, str) else json.dumps(v))
def test_int_checkpoints_read_back_exactly_and_within_half_a_step(source: Path, write, method, options) -> None:
    dst = write(method, **options)
    config = checkpoint_quant_config(json.loads((dst / "config.json").read_text()))
    assert (config.method, config.bits, config.group_size) == (method, options.get("bits", 4), options["group_size"])
    assert config.sym == options.get("sym", method == "gptq") and config.desc_act == options.get("desc_act", False)
    original, state = load_file(source / "model.safetensors"), load_checkpoint(dst)
    assert all(f"{m}.qweight" in state for m in target_modules(original))
    for module in target_modules(original)[len(PROJECTIONS) :]:  # one layer is enough to check the values
        tensors = module_tensors(state, method, module)
        assert tensors["qweight"].dtype == torch.int32 and tensors["scales"].dtype == torch.float16
        assert f"{module}.weight" not in state
        weight = build_quantized_weight(config, tensors)
        assert isinstance(weight, IntWeight) and weight.bits == config.bits
        if method == "awq":
            reference = ref_dequant_awq(tensors, config.group_size)
        else:
            reference = ref_dequant_gptq(tensors, config.bits, zero_offset=1)
        assert torch.equal(weight.dequantize_checkpoint_order(), reference), module
        w = original[f"{module}.weight"].float()
        step = ref_group_scale_of_each_element(tensors, config.group_size)
        assert ((w - reference).abs() <= step * 0.5 * (1 + 2**-20)).all(), module  # round to nearest


def test_awq_without_zero_points_stores_midpoint_zeros(write) -> None:
    dst = write("awq", group_size=64, sym=True)
    config = checkpoint_quant_config(json.loads((dst / "config.json").read_text()))
    tensors = module_tensors(load_checkpoint(dst), "awq", "model.layers.1.mlp.down_proj")
    assert (ref_unpack_cols(tensors["qzeros"], 4, tuple(range(8))) == 8).all()
    without_zeros = build_quantized_weight(config, {k: v for k, v in tensors.items() if k != "qzeros"})
    assert torch.equal(without_zeros.dequantize(), build_quantized_weight(config, tensors).dequantize())


def test_act_order_shares_one_input_permutation_per_layer_input(write) -> None:
    dst = write("gptq", bits=4, group_size=32, desc_act=True)
    config = checkpoint_quant_config(json.loads((dst / "config.json").read_text()))
    state = load_checkpoint(dst)
    layer = "model.layers.0"
    weights = {p: build_quantized_weight(config, module_tensors(state, "gptq", f"{layer}.{p}")) for p in PROJECTIONS}
    g_idx = state[f"{layer}.self_attn.q_proj.g_idx"]
    assert not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // 32)  # really permuted
    assert torch.equal(torch.bincount(g_idx.long()), torch.full((g_idx.numel() // 32,), 32))
    qkv = IntWeight.concat([weights[p] for p in PROJECTIONS[:3]])
    gate_up = IntWeight.concat([weights["mlp.gate_proj"], weights["mlp.up_proj"]])
    assert torch.equal(
        qkv.dequantize_checkpoint_order()[:128], weights["self_attn.q_proj"].dequantize_checkpoint_order()
    )
    assert gate_up.perm is not None and not torch.equal(qkv.perm, weights["self_attn.o_proj"].perm)
    other_layer = state["model.layers.1.self_attn.q_proj.g_idx"]
    assert not torch.equal(g_idx, other_layer)
    # The kernel reads x[..., perm]: with that input order the weight's groups are contiguous.
    x = torch.randn(3, 128)
    q = weights["self_attn.q_proj"]
    assert torch.allclose(x[:, q.perm] @ q.dequantize().t(), x @ q.dequantize_checkpoint_order().t(), atol=1e-4)


def test_gptq_v2_checkpoints_store_zeros_without_offset(write) -> None:
    dst = write("gptq", bits=4, group_size=64, sym=False)
    v1 = module_tensors(load_checkpoint(dst), "gptq", "model.layers.0.mlp.up_proj")
    zeros = (ref_unpack_cols(v1["qzeros"], 4, tuple(range(8))) + 1) % 16  # the real zero points
    words = sum(zeros[:, j::8] << (4 * j) for j in range(8))
    v2 = {**v1, "qzeros": torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)}
    config_v2 = checkpoint_quant_config({"quantization_config": {**GPTQ_MODEL_V2, "group_size": 64, "sym": False}})
    config_v1 = checkpoint_quant_config(json.loads((dst / "config.json").read_text()))
    from_v2 = build_quantized_weight(config_v2, v2).dequantize_checkpoint_order()
    assert torch.equal(from_v2, build_quantized_weight(config_v1, v1).dequantize_checkpoint_order())
    assert torch.equal(from_v2, ref_dequant_gptq(v2, 4, zero_offset=0))


def test_gptq_g_idx_rules() -> None:
    in_features, out_features = 64, 16
    qweight = torch.randint(-(2**31), 2**31 - 1, (in_features // 8, out_features), dtype=torch.int32)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (4, out_features // 8), dtype=torch.int32)
    scales = torch.rand(4, out_features).half()
    config = QuantConfig("gptq", True, bits=4, group_size=16)
    trivial = torch.arange(in_features, dtype=torch.int32) // 16
    assert int_weight_from_gptq(qweight, qzeros, scales, trivial, config).perm is None
    assert int_weight_from_gptq(qweight, qzeros, scales, None, config).perm is None
    shuffled = trivial[torch.randperm(in_features)]
    permuted = int_weight_from_gptq(qweight, qzeros, scales, shuffled, config)
    assert torch.equal(shuffled[permuted.perm].long(), trivial.long())
    uneven = trivial.clone()
    uneven[0] = 1  # group 0 has 15 inputs, group 1 has 17
    with pytest.raises(ValueError, match="exactly 16 inputs"):
        int_weight_from_gptq(qweight, qzeros, scales, uneven, config)
    with pytest.raises(ValueError, match="desc_act"):
        int_weight_from_gptq(qweight, qzeros, scales, None, QuantConfig("gptq", True, 4, 16, desc_act=True))
    whole = QuantConfig("gptq", True, bits=4, group_size=-1)
    single = int_weight_from_gptq(qweight, qzeros[:1], scales[:1], None, whole)
    assert single.group_size == in_features and single.scales.shape == (1, out_features)


FP8_CASES = [
    dict(fp8_weight_strategy="channel"),
    dict(fp8_weight_strategy="tensor"),
    dict(fp8_weight_strategy="channel", fp8_static_activations=True),
    dict(fp8_weight_strategy="tensor", fp8_static_activations=True),
]


@pytest.mark.parametrize("options", FP8_CASES, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_fp8_checkpoints_read_back_exactly_and_within_e4m3_rounding(source: Path, write, options) -> None:
    dst = write("fp8", **options)
    config = checkpoint_quant_config(json.loads((dst / "config.json").read_text()))
    static = options.get("fp8_static_activations", False)
    assert config.fp8_weight_strategy == options["fp8_weight_strategy"]
    assert config.fp8_dynamic_activations is not static and config.is_ignored("lm_head")
    original, state = load_file(source / "model.safetensors"), load_checkpoint(dst)
    for module in target_modules(original):
        tensors = module_tensors(state, "fp8", module)
        assert tensors["weight"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].dtype == torch.float32
        expected_shape = (tensors["weight"].shape[0], 1) if config.fp8_weight_strategy == "channel" else (1,)
        assert tuple(tensors["weight_scale"].shape) == expected_shape
        assert ("input_scale" in tensors) is static
        weight = build_quantized_weight(config, tensors)
        assert isinstance(weight, Fp8Weight) and (weight.input_scale is not None) is static
        reference = tensors["weight"].float() * tensors["weight_scale"]  # broadcasts [out, 1] and [1]
        assert torch.equal(weight.dequantize(), reference), module
        # e4m3 keeps 3 mantissa bits: half a step is |x| / 16 for normals, 2**-10 below 2**-6 (subnormals).
        w, scale = original[f"{module}.weight"], tensors["weight_scale"]
        bound = torch.maximum(w.abs() / 16, scale * 2**-10) * (1 + 2**-20)
        assert ((w - reference).abs() <= bound).all(), module
    assert not is_quantized_module("fp8", set(state), "lm_head") and torch.equal(
        state["lm_head.weight"], original["lm_head.weight"]
    )
    if static:  # projections reading the same activations saw the same largest input
        layer = "model.layers.1"
        scales = {p: state[f"{layer}.{p}.input_scale"] for p in PROJECTIONS}
        assert all(s.dtype == torch.float32 and s.shape == (1,) and s.item() > 0 for s in scales.values())
        assert scales["self_attn.q_proj"] == scales["self_attn.k_proj"] == scales["self_attn.v_proj"]
        assert scales["mlp.gate_proj"] == scales["mlp.up_proj"]


def test_fp8_converter_broadcasts_tensor_scales_and_rejects_block_scales() -> None:
    q = torch.randn(8, 16).to(torch.float8_e4m3fn)
    for per_tensor in (torch.tensor([0.5]), torch.tensor(0.5), torch.tensor([0.5], dtype=torch.bfloat16)):
        weight = fp8_weight_from_checkpoint(q, per_tensor, torch.tensor([2.0]))
        assert torch.equal(weight.scales, torch.full((8,), 0.5)) and weight.input_scale.item() == 2.0
    per_row = fp8_weight_from_checkpoint(q, torch.arange(8.0).reshape(8, 1).half(), None)
    assert torch.equal(per_row.scales, torch.arange(8.0)) and per_row.input_scale is None
    with pytest.raises(ValueError, match="block-wise"):
        fp8_weight_from_checkpoint(q, torch.ones(2, 4), None)  # [out/4, in/4] blocks
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_weight_from_checkpoint(q.float(), torch.tensor([1.0]), None)


def test_sharded_bf16_source_keeps_shards_biases_and_extra_files(tiny, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny.get("qwen2", torch.bfloat16, max_shard_size="200KB", **SHAPES), src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    dst = write_quantized_checkpoint(src, tmp_path / "dst", "gptq", bits=8, group_size=64, desc_act=True)
    original, state = load_checkpoint(src), load_checkpoint(dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and set(index) == set(state)
    for name, shard in index.items():
        assert name in load_file(dst / shard)
    config = checkpoint_quant_config(json.loads((dst / "config.json").read_text()))
    for module in target_modules(original):
        tensors = module_tensors(state, "gptq", module)
        dequantized = build_quantized_weight(config, tensors).dequantize_checkpoint_order()
        assert torch.equal(dequantized, ref_dequant_gptq(tensors, 8, zero_offset=1))
        assert (original[f"{module}.weight"].float() - dequantized).abs().max() < 0.01
    untouched = [n for n in original if not any(n.endswith(f"{p}.weight") for p in PROJECTIONS)]
    assert any(n.endswith("q_proj.bias") for n in untouched)
    assert all(torch.equal(state[n], original[n]) and state[n].dtype == original[n].dtype for n in untouched)
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_text() == (src / name).read_text()


def test_written_configs_are_what_the_tools_write(write) -> None:
    awq = json.loads((write("awq", group_size=128) / "config.json").read_text())["quantization_config"]
    assert awq == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    gptq = json.loads((write("gptq", bits=4, group_size=128) / "config.json").read_text())["quantization_config"]
    assert gptq["checkpoint_format"] == "gptq" and gptq["static_groups"] is False and gptq["sym"] is True
    fp8 = json.loads((write("fp8", fp8_weight_strategy="channel") / "config.json").read_text())["quantization_config"]
    assert fp8["ignore"] == ["lm_head"] and fp8["format"] == "float-quantized"
    assert fp8["quantization_status"] == "compressed"


def test_writer_and_converter_errors(source: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not divide"):
        write_quantized_checkpoint(source, tmp_path / "a", "gptq", group_size=48)
    with pytest.raises(ValueError, match="4-bit"):
        write_quantized_checkpoint(source, tmp_path / "b", "awq", bits=8)
    with pytest.raises(ValueError, match="int8 is quantized at load"):
        write_quantized_checkpoint(source, tmp_path / "c", "int8")
    with pytest.raises(ValueError, match="lacks checkpoint tensors"):
        build_quantized_weight(QuantConfig("gptq", True, 4, 128), {"qweight": torch.zeros(16, 8, dtype=torch.int32)})
    with pytest.raises(ValueError, match="quantized at load"):
        build_quantized_weight(QuantConfig("int8", False, 8), {})


def test_quantized_modules_are_judged_from_tensor_names(write) -> None:
    names = set(load_checkpoint(write("awq", group_size=128)))
    assert is_quantized_module("awq", names, "model.layers.0.self_attn.q_proj")
    assert not is_quantized_module("awq", names, "lm_head")
    with pytest.raises(ValueError):
        is_quantized_module("int8", names, "lm_head")


# ---------------------------------------------------------------------------------------------------------------
# Cross-check with the reference implementation of the format (skipped when compressed-tensors is not installed)


@pytest.mark.parametrize("options", FP8_CASES[1:3], ids=["tensor-dynamic", "channel-static"])
def test_compressed_tensors_reads_and_writes_the_same_fp8(source: Path, write, options) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    dst = write("fp8", **options)
    raw = json.loads((dst / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(raw).config_groups["group_0"]  # the library accepts our config
    config = checkpoint_quant_config({"quantization_config": raw})
    original, state = load_file(source / "model.safetensors"), load_checkpoint(dst)
    for module in target_modules(original)[:7]:
        tensors = module_tensors(state, "fp8", module)
        theirs = FloatQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
        assert torch.equal(theirs, build_quantized_weight(config, tensors).dequantize()), module
        recompressed = FloatQuantizationCompressor.compress(
            {"weight": original[f"{module}.weight"], "weight_scale": tensors["weight_scale"]}, scheme
        )["weight"]
        assert torch.equal(recompressed.view(torch.uint8), tensors["weight"].view(torch.uint8)), module


def test_save_roundtrip_of_a_hand_made_awq_module(tmp_path: Path) -> None:
    """A hand-packed AWQ module (known values in known nibbles) decodes to exactly those values."""
    in_features, out_features = 32, 16
    values = torch.randint(0, 16, (in_features, out_features))
    zeros = torch.randint(0, 16, (1, out_features))
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def pack(v: torch.Tensor) -> torch.Tensor:
        words = sum(v[:, order[j] :: 8] << (4 * j) for j in range(8))
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    path = tmp_path / "awq.safetensors"
    save_file(
        {"qweight": pack(values), "qzeros": pack(zeros), "scales": torch.full((1, out_features), 0.5).half()}, path
    )
    weight = build_quantized_weight(QuantConfig("awq", True, 4, -1, sym=False), load_file(path))
    assert torch.equal(weight.qweight.long(), values.t()) and torch.equal(weight.zeros.long(), zeros)
    assert torch.equal(weight.dequantize(), (values - zeros).t().float() * 0.5)
