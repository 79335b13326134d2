"""Which quantization a checkpoint uses (config.json's ``quantization_config``) and which one the engine serves.

Supported checkpoint formats, as the quantizers write them:

- AWQ (AutoAWQ / GPTQModel, ``quant_method: awq``): version ``gemm``, 4 bits, with or without zero points.
- GPTQ (AutoGPTQ / GPTQModel / optimum, ``quant_method: gptq``): 4 or 8 bits, symmetric or not, act order
  (``desc_act``), checkpoint formats ``gptq`` (zero points stored minus one) and ``gptq_v2``.
- compressed-tensors FP8 (llm-compressor, ``quant_method: compressed-tensors``): float8 e4m3 weights with a per-tensor
  or per-channel scale, activations dynamic (per token) or static (one ``input_scale`` per layer).

Unquantized checkpoints can be quantized at load (``int8`` weight-only, ``fp8``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

QUANTIZATION_METHODS = ("awq", "gptq", "fp8", "int8")
ONLINE_METHODS = ("int8", "fp8")  # quantized at load from a 16/32-bit checkpoint

_AWQ_GROUP_SIZES = (32, 64, 128, -1)
_GPTQ_FORMAT_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}
_CT_FORMATS = ("float-quantized", "naive-quantized")
_SUPPORTED_SUMMARY = (
    "Pagoda serves AWQ (version 'gemm', 4-bit, group size 32/64/128/-1, with or without zero points), "
    "GPTQ (4 or 8 bits, sym or asym, desc_act, checkpoint_format 'gptq' or 'gptq_v2') and compressed-tensors FP8 "
    "(format 'float-quantized' or 'naive-quantized': 8-bit float weights with a per-tensor or per-channel scale, "
    "activations dynamic per token or static per tensor) checkpoints"
)


@dataclass(frozen=True)
class QuantConfig:
    """The quantization the engine serves a model with."""

    method: str  # "awq" | "gptq" | "fp8" | "int8"
    serialized: bool  # True: the checkpoint holds quantized tensors; False: quantized at load (int8, fp8 online)
    bits: int = 16  # 4 or 8 for awq/gptq, 8 for fp8/int8
    group_size: int = -1  # as the checkpoint says; -1 = one group per output channel (whole input)
    sym: bool = True
    desc_act: bool = False
    gptq_zero_offset: int = 1  # GPTQ "gptq" (v1) checkpoints store zero-1; "gptq_v2" stores zero: 0
    fp8_weight_strategy: str = ""  # "tensor" | "channel" (fp8 checkpoints)
    fp8_dynamic_activations: bool = True  # False: static per-tensor input_scale tensors in the checkpoint
    # Module names (or "re:<regex>", matched from the start of the name) left unquantized.
    ignore: tuple[str, ...] = ()

    def is_ignored(self, module_name: str) -> bool:
        """Whether the checkpoint's config leaves ``module_name`` (e.g. ``"lm_head"``) unquantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module_name):
                    return True
            elif pattern == module_name:
                return True
        return False

    def describe(self) -> str:
        """A short human description, e.g. ``"GPTQ 4-bit (group size 128, act order)"``, for messages."""
        if not self.serialized:
            return f"{self.method} quantized at load"
        if self.method == "fp8":
            acts = "dynamic" if self.fp8_dynamic_activations else "static"
            return f"FP8 (per-{self.fp8_weight_strategy} weight scales, {acts} activation scales)"
        extras = [f"group size {self.group_size}", "symmetric" if self.sym else "with zero points"]
        if self.desc_act:
            extras.append("act order")
        return f"{self.method.upper()} {self.bits}-bit ({', '.join(extras)})"


def checkpoint_quant_config(hf_config: dict) -> Optional[QuantConfig]:
    """The quantization of a checkpoint from its config.json (None when it has no ``quantization_config``, and for
    gpt-oss's MXFP4 experts, which the model class reads itself: :mod:`pagoda.quantization.mxfp4`).

    Raises ValueError naming what is unsupported (and what is supported) for any other format.
    """
    # Early llm-compressor checkpoints named the key "compression_config".
    qc = hf_config.get("quantization_config", hf_config.get("compression_config"))
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _parse_awq(qc)
    if method == "gptq":
        return _parse_gptq(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == "mxfp4":
        return _check_mxfp4(hf_config)
    detail = ""
    if "weight_block_size" in qc:
        detail = f" with block-wise FP8 scales (weight_block_size {qc['weight_block_size']})"
    raise ValueError(f"unsupported checkpoint quantization: quant_method {method!r}{detail}. {_SUPPORTED_SUMMARY}")


def resolve_quant_config(requested: Optional[str], hf_config: dict) -> Optional[QuantConfig]:
    """The quantization the engine serves, from ``--quantization`` (``requested``) and the checkpoint's config.

    - ``requested`` None: the checkpoint's own quantization (or None for a 16/32-bit checkpoint);
    - ``requested`` equal to the checkpoint's method: the checkpoint's quantization;
    - ``"int8"`` / ``"fp8"`` on an unquantized checkpoint: quantized at load;
    - anything else raises ValueError saying what the checkpoint is and what to pass instead.
    """
    checkpoint = checkpoint_quant_config(hf_config)
    if requested is None:
        return checkpoint
    method = requested.lower()
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {requested!r}; choose from {', '.join(QUANTIZATION_METHODS)}")
    if checkpoint is not None:
        if method == checkpoint.method:
            return checkpoint
        raise ValueError(
            f"--quantization {method} does not apply to this checkpoint: it is already quantized with "
            f"{checkpoint.describe()}; pass --quantization {checkpoint.method} or omit --quantization"
        )
    if method in ONLINE_METHODS:
        return QuantConfig(method, serialized=False, bits=8)
    if _is_mxfp4(hf_config):
        raise ValueError(
            f"--quantization {method} does not apply to this checkpoint: its experts are MXFP4, served as published; "
            f"omit --quantization, or pass {' or '.join(ONLINE_METHODS)} to quantize its other layers at load"
        )
    raise ValueError(
        f"--quantization {method} needs a {method.upper()} checkpoint, but this checkpoint is not quantized "
        f"(no quantization_config in config.json); to quantize it at load pass --quantization "
        f"{' or '.join(ONLINE_METHODS)}, or serve a {method.upper()}-quantized checkpoint"
    )


MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)  # whose model classes read MXFP4 experts (gpt-oss as published)


def _is_mxfp4(hf_config: dict) -> bool:
    qc = hf_config.get("quantization_config")
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4"


def _check_mxfp4(hf_config: dict) -> None:
    """None (the model reads the experts' blocks and scales) for the architectures that have MXFP4 experts."""
    architectures = hf_config.get("architectures") or []
    if not set(architectures) & set(MXFP4_ARCHITECTURES):
        raise _unsupported(
            f"MXFP4 (quant_method 'mxfp4') for {', '.join(map(str, architectures)) or 'this architecture'}; "
            f"MXFP4 experts are served for {', '.join(MXFP4_ARCHITECTURES)}"
        )
    return None


def _unsupported(what: str) -> ValueError:
    return ValueError(f"unsupported checkpoint quantization: {what}. {_SUPPORTED_SUMMARY}")


def _parse_awq(qc: dict[str, Any]) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported(f"AWQ version {version!r} (only the 'gemm' packing is supported)")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise _unsupported(f"AWQ with {bits} bits (AWQ 'gemm' checkpoints are 4-bit)")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group_size not in _AWQ_GROUP_SIZES:
        raise _unsupported(f"AWQ group size {group_size} (supported: {_AWQ_GROUP_SIZES})")
    # AutoAWQ skips every module whose name *contains* one of these strings.
    skip = qc.get("modules_to_not_convert") or ()
    ignore = tuple(f"re:.*{re.escape(str(name))}" for name in skip)
    zero_point = bool(qc.get("zero_point", True))
    return QuantConfig("awq", True, bits=4, group_size=group_size, sym=not zero_point, ignore=ignore)


def _parse_gptq(qc: dict[str, Any]) -> QuantConfig:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise _unsupported(f"GPTQ with {bits} bits (supported: 4 and 8)")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in _GPTQ_FORMAT_ZERO_OFFSET:
        raise _unsupported(f"GPTQ checkpoint_format {fmt!r} (supported: {', '.join(_GPTQ_FORMAT_ZERO_OFFSET)})")
    if qc.get("dynamic"):
        raise _unsupported("GPTQ with per-module overrides ('dynamic')")
    if qc.get("lm_head"):
        raise _unsupported("GPTQ with a quantized lm_head ('lm_head': true)")
    group_size = int(qc.get("group_size", -1))
    if group_size == 0 or group_size < -1:
        raise ValueError(f"invalid GPTQ group_size {group_size}: a positive group size, or -1 for one group")
    return QuantConfig(
        "gptq",
        True,
        bits=bits,
        group_size=group_size,
        sym=bool(qc.get("sym", True)),
        desc_act=bool(qc.get("desc_act", False)),
        gptq_zero_offset=_GPTQ_FORMAT_ZERO_OFFSET[fmt],
    )


def _parse_compressed_tensors(qc: dict[str, Any]) -> Optional[QuantConfig]:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise _unsupported(f"compressed-tensors format {fmt!r}")
    # quantization_status is not checked: early FP8 checkpoints say "frozen" yet store float8 weights; the
    # converters check the tensors' dtypes instead.
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _unsupported(f"compressed-tensors sparsity ({sparsity.get('format')!r})")
    if qc.get("transform_config"):
        raise _unsupported("compressed-tensors transform_config")
    kv_scheme = qc.get("kv_cache_scheme")
    if kv_scheme and not _static_fp8_tensor_scheme(kv_scheme):
        raise _unsupported(f"compressed-tensors kv_cache_scheme {kv_scheme!r} (only static per-tensor FP8)")
    groups = qc.get("config_groups") or {}
    if not groups:
        if kv_scheme:  # KV-cache scales only (k_scale/v_scale tensors, read with --kv-cache-dtype fp8_*)
            return None
        raise _unsupported("compressed-tensors without config_groups")
    schemes = {_ct_fp8_scheme(name, group) for name, group in groups.items()}
    if len(schemes) != 1:
        raise _unsupported(f"compressed-tensors config groups with different FP8 schemes {sorted(schemes)}")
    strategy, dynamic = schemes.pop()
    ignore = tuple(str(name) for name in qc.get("ignore") or ())
    return QuantConfig(
        "fp8", True, bits=8, fp8_weight_strategy=strategy, fp8_dynamic_activations=dynamic, ignore=ignore
    )


def _static_fp8_tensor_scheme(scheme: dict[str, Any]) -> bool:
    """A KV-cache scheme whose per-layer k_scale/v_scale tensors the FP8 KV cache can use as they are."""
    kind = (scheme.get("num_bits"), scheme.get("type"), scheme.get("strategy"), bool(scheme.get("dynamic", False)))
    return kind == (8, "float", "tensor", False) and scheme.get("symmetric", True)


def _ct_fp8_scheme(name: str, group: dict[str, Any]) -> tuple[str, bool]:
    """(weight strategy, dynamic activations) of one compressed-tensors config group, or ValueError."""
    if group.get("format") not in (None, *_CT_FORMATS):
        raise _unsupported(f"compressed-tensors config group {name!r} with format {group['format']!r}")
    weights = group.get("weights")
    if not weights:
        raise _unsupported(f"compressed-tensors config group {name!r} without quantized weights")
    kind = f"{weights.get('num_bits')}-bit {weights.get('type')}"
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise _unsupported(f"compressed-tensors {kind} weights in group {name!r} (only 8-bit float weights)")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel") or weights.get("block_structure") or weights.get("group_size"):
        raise _unsupported(f"compressed-tensors FP8 weight strategy {strategy!r} (supported: tensor, channel)")
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise _unsupported("compressed-tensors FP8 weights that are asymmetric or dynamic")
    if group.get("output_activations"):
        raise _unsupported("compressed-tensors output activation quantization")
    acts = group.get("input_activations")
    if not acts:
        return strategy, True
    if (acts.get("num_bits"), acts.get("type")) != (8, "float") or not acts.get("symmetric", True):
        raise _unsupported(f"compressed-tensors input activations {acts.get('num_bits')}-bit {acts.get('type')}")
    if acts.get("dynamic") is True and acts.get("strategy") == "token":
        return strategy, True
    if not acts.get("dynamic") and acts.get("strategy") == "tensor":
        return strategy, False
    raise _unsupported(
        f"compressed-tensors FP8 activations with strategy {acts.get('strategy')!r}, dynamic "
        f"{acts.get('dynamic')!r} (supported: dynamic per token, or static per tensor)"
    )
