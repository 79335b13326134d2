"""config.json's ``quantization_config`` as the published tools write it: what the engine reads from it, what it
refuses (naming the problem and what is supported), and how ``--quantization`` is resolved against it."""

from __future__ import annotations

import json
from typing import Any, Optional

import pytest

from pagoda.quantization.config import QuantConfig, checkpoint_quant_config, resolve_quant_config

# ---------------------------------------------------------------------------------------------------------------
# config.json parsing (dicts as published on the Hugging Face hub)

# config.json's quantization_config of published checkpoints (AutoAWQ, transformers' AwqConfig, AutoGPTQ, optimum,
# GPTQModel), verbatim apart from the group sizes.
AWQ_AUTOAWQ = json.loads('{"quant_method": "awq", "zero_point": true, "group_size": 128, "bits": 4, "version": "gemm"}')
AWQ_TRANSFORMERS = json.loads(
    '{"backend": "autoawq", "bits": 4, "do_fuse": false, "fuse_max_seq_len": null, "group_size": 64, '
    '"modules_to_fuse": null, "modules_to_not_convert": ["visual"], "quant_method": "awq", "version": "GEMM", '
    '"zero_point": true}'
)
GPTQ_AUTOGPTQ = json.loads(
    '{"bits": 4, "group_size": 128, "damp_percent": 0.1, "desc_act": true, "sym": true, "true_sequential": true, '
    '"model_name_or_path": null, "model_file_base_name": "model", "quant_method": "gptq"}'
)
GPTQ_OPTIMUM_INT8 = json.loads(
    '{"batch_size": 1, "bits": 8, "cache_block_outputs": true, "damp_percent": 0.01, "desc_act": false, '
    '"exllama_config": {"version": 1}, "group_size": -1, "modules_in_block_to_quantize": null, '
    '"quant_method": "gptq", "sym": false, "true_sequential": true, "use_exllama": true}'
)
GPTQ_MODEL_V2 = json.loads(
    '{"bits": 4, "checkpoint_format": "gptq_v2", "desc_act": false, "group_size": 32, "lm_head": false, '
    '"meta": {"quantizer": ["gptqmodel:2.0.0"]}, "pack_dtype": "int32", "quant_method": "gptq", '
    '"static_groups": false, "sym": true}'
)


CT_IGNORE = ("lm_head", "re:.*mlp.gate$")


def _ct_args(strategy: str, dynamic: bool = False) -> dict[str, Any]:
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": dynamic,
        "group_size": None,
        "num_bits": 8,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
        "strategy": strategy,
        "symmetric": True,
        "type": "float",
    }


def _ct_config(weights: dict, activations: Optional[dict], fmt: str = "float-quantized", **extra: Any) -> dict:
    group = {"input_activations": activations, "output_activations": None, "targets": ["Linear"], "weights": weights}
    return {
        "config_groups": {"group_0": group},
        "format": fmt,
        "global_compression_ratio": 1.46,
        "ignore": list(CT_IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "version": "0.6.0.20240911",
        **extra,
    }


CT_FP8_DYNAMIC = _ct_config(_ct_args("channel"), _ct_args("token", dynamic=True))
CT_FP8_STATIC = _ct_config(_ct_args("tensor"), _ct_args("tensor"), fmt="naive-quantized")
CT_FP8_WEIGHT_ONLY = _ct_config(_ct_args("channel"), None)


@pytest.mark.parametrize(
    "quantization_config, expected",
    [
        pytest.param(AWQ_AUTOAWQ, QuantConfig("awq", True, 4, 128, sym=False), id="awq"),
        pytest.param(
            AWQ_TRANSFORMERS, QuantConfig("awq", True, 4, 64, sym=False, ignore=("re:.*visual",)), id="awq-hf"
        ),
        pytest.param({**AWQ_AUTOAWQ, "zero_point": False}, QuantConfig("awq", True, 4, 128, sym=True), id="awq-sym"),
        pytest.param(GPTQ_AUTOGPTQ, QuantConfig("gptq", True, 4, 128, sym=True, desc_act=True), id="gptq-act-order"),
        pytest.param(GPTQ_OPTIMUM_INT8, QuantConfig("gptq", True, 8, -1, sym=False), id="gptq-int8"),
        pytest.param(GPTQ_MODEL_V2, QuantConfig("gptq", True, 4, 32, gptq_zero_offset=0), id="gptq-v2"),
        pytest.param(
            CT_FP8_DYNAMIC, QuantConfig("fp8", True, 8, fp8_weight_strategy="channel", ignore=CT_IGNORE), id="fp8"
        ),
        pytest.param(
            CT_FP8_STATIC,
            QuantConfig("fp8", True, 8, fp8_weight_strategy="tensor", fp8_dynamic_activations=False, ignore=CT_IGNORE),
            id="fp8-static",
        ),
        pytest.param(
            CT_FP8_WEIGHT_ONLY,
            QuantConfig("fp8", True, 8, fp8_weight_strategy="channel", ignore=CT_IGNORE),
            id="fp8-weight-only",
        ),
    ],
)
def test_published_quantization_configs_parse(quantization_config: dict, expected: QuantConfig) -> None:
    assert checkpoint_quant_config({"quantization_config": quantization_config}) == expected


def test_a_static_fp8_kv_cache_scheme_is_read_and_alone_quantizes_no_weights() -> None:
    # llm-compressor's FP8-KV checkpoints: per-layer k_scale/v_scale tensors, used with --kv-cache-dtype fp8_*
    with_kv = {**CT_FP8_DYNAMIC, "kv_cache_scheme": _ct_args("tensor")}
    assert checkpoint_quant_config({"quantization_config": with_kv}) == checkpoint_quant_config(
        {"quantization_config": CT_FP8_DYNAMIC}
    )
    kv_only = {**with_kv, "config_groups": {}}
    assert checkpoint_quant_config({"quantization_config": kv_only}) is None


def test_unquantized_config_has_no_quantization() -> None:
    assert checkpoint_quant_config({"model_type": "llama", "hidden_size": 64}) is None


def test_early_compressed_tensors_key_and_frozen_status_parse() -> None:
    config = {**CT_FP8_STATIC, "quantization_status": "frozen"}
    parsed = checkpoint_quant_config({"compression_config": config})
    assert parsed is not None and parsed.method == "fp8" and not parsed.fp8_dynamic_activations


def test_ignore_lists_match_names_and_regexes() -> None:
    fp8 = checkpoint_quant_config({"quantization_config": CT_FP8_DYNAMIC})
    assert fp8.is_ignored("lm_head") and fp8.is_ignored("model.layers.3.mlp.gate")
    assert not fp8.is_ignored("model.layers.3.mlp.gate_proj") and not fp8.is_ignored("model.lm_head_x")
    awq = checkpoint_quant_config({"quantization_config": AWQ_TRANSFORMERS})
    assert awq.is_ignored("model.visual.blocks.0.attn.qkv")  # AutoAWQ matches substrings
    assert not awq.is_ignored("model.layers.0.self_attn.q_proj")


@pytest.mark.parametrize(
    "quantization_config, named",
    [
        ({**AWQ_AUTOAWQ, "version": "gemv"}, "'gemv'"),
        ({**AWQ_AUTOAWQ, "version": "exllama"}, "'exllama'"),
        ({**AWQ_AUTOAWQ, "version": "marlin"}, "'marlin'"),
        ({**AWQ_AUTOAWQ, "bits": 3}, "3 bits"),
        ({**GPTQ_AUTOGPTQ, "bits": 3}, "3 bits"),
        ({**GPTQ_AUTOGPTQ, "bits": 2}, "2 bits"),
        ({**GPTQ_MODEL_V2, "checkpoint_format": "marlin"}, "'marlin'"),
        ({**GPTQ_AUTOGPTQ, "is_marlin_format": True}, "'marlin'"),
        ({**GPTQ_MODEL_V2, "dynamic": {"-:.*down_proj": {}}}, "dynamic"),
        (
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
            "weight_block_size",
        ),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "'bitsandbytes'"),
        (
            _ct_config(
                {**_ct_args("group"), "num_bits": 4, "type": "int", "group_size": 128}, None, fmt="pack-quantized"
            ),
            "'pack-quantized'",
        ),
        (_ct_config({**_ct_args("channel"), "type": "int"}, _ct_args("token", True), fmt="int-quantized"), "int-q"),
        (_ct_config({**_ct_args("channel"), "type": "int"}, None, fmt="naive-quantized"), "8-bit int weights"),
        (
            _ct_config({**_ct_args("block"), "block_structure": [128, 128]}, _ct_args("group", True)),
            "strategy 'block'",
        ),
        (_ct_config(_ct_args("channel"), _ct_args("tensor", dynamic=True)), "strategy 'tensor', dynamic True"),
        ({**CT_FP8_DYNAMIC, "kv_cache_scheme": _ct_args("tensor", dynamic=True)}, "kv_cache_scheme"),
    ],
)
def test_unsupported_formats_raise_naming_the_problem_and_the_alternatives(quantization_config, named) -> None:
    with pytest.raises(ValueError) as error:
        checkpoint_quant_config({"quantization_config": quantization_config})
    message = str(error.value)
    assert named in message
    assert "AWQ" in message and "GPTQ" in message and "FP8" in message  # says what is supported


AWQ_CHECKPOINT = {"quantization_config": AWQ_AUTOAWQ}
GPTQ_CHECKPOINT = {"quantization_config": GPTQ_AUTOGPTQ}
FP8_CHECKPOINT = {"quantization_config": CT_FP8_DYNAMIC}
PLAIN = {"model_type": "llama"}


def test_resolve_quantization_follows_the_checkpoint() -> None:
    assert resolve_quant_config(None, PLAIN) is None
    assert resolve_quant_config(None, AWQ_CHECKPOINT) == checkpoint_quant_config(AWQ_CHECKPOINT)
    assert resolve_quant_config("awq", AWQ_CHECKPOINT) == checkpoint_quant_config(AWQ_CHECKPOINT)
    assert resolve_quant_config("GPTQ", GPTQ_CHECKPOINT) == checkpoint_quant_config(GPTQ_CHECKPOINT)
    assert resolve_quant_config("fp8", FP8_CHECKPOINT).serialized
    assert resolve_quant_config("int8", PLAIN) == QuantConfig("int8", serialized=False, bits=8)
    assert resolve_quant_config("fp8", PLAIN) == QuantConfig("fp8", serialized=False, bits=8)


@pytest.mark.parametrize(
    "requested, hf_config, says",
    [
        ("awq", PLAIN, ["not quantized", "int8", "fp8"]),
        ("gptq", PLAIN, ["not quantized", "int8"]),
        ("awq", GPTQ_CHECKPOINT, ["GPTQ 4-bit", "--quantization gptq"]),
        ("int8", AWQ_CHECKPOINT, ["AWQ 4-bit", "--quantization awq"]),
        ("fp8", GPTQ_CHECKPOINT, ["GPTQ", "--quantization gptq"]),
        ("gptq", FP8_CHECKPOINT, ["FP8", "--quantization fp8"]),
        ("nf4", PLAIN, ["unknown quantization", "awq, gptq, fp8, int8"]),
    ],
)
def test_resolve_quantization_rejects_mismatches_and_says_what_to_pass(requested, hf_config, says) -> None:
    with pytest.raises(ValueError) as error:
        resolve_quant_config(requested, hf_config)
    for words in says:
        assert words in str(error.value)
