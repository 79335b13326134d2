"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) onto the model's layers.

PEFT names a tensor ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``; Pagoda fuses
q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, so each of those projections becomes one slice of the
fused layer with its own A and B. Anything the engine cannot apply exactly (DoRA, biases, embedding or lm_head
targets, per-module rank or alpha patterns, a rank above ``--max-lora-rank``, shapes that do not fit the base
model) is a :class:`LoRAAdapterError` naming the adapter and the field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT projection name -> (Pagoda module under a decoder layer, slice of its fused output)
PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# Checkpoints that store a projection already fused (Phi-3's qkv_proj and gate_up_proj) train adapters on the fused
# module: one A, and a B whose rows are the slices in order. Each slice gets the shared A and its rows of B, which
# is the same product.
FUSED_PROJECTIONS: dict[str, str] = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}
WHOLE = -1  # the part index of a fused target: every slice of the module
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields whose non-default values change the math in ways not served here
_UNSUPPORTED_SETTINGS = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layer_replication": (None,),
    "lora_bias": (False, None),
    "trainable_token_indices": (None,),
}


class LoRAAdapterError(ValueError):
    """This adapter cannot be served; the message names the adapter and the field or tensor at fault."""


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights in the model dtype, on the host, ready to copy into a slot.

    ``weights[module][slice] = (A [rank, in_features], B [slice_out, rank])`` with the scaling folded into B;
    ``module`` is a Pagoda module name such as ``layers.3.self_attn.qkv_proj``.
    """

    name: str
    path: str
    rank: int
    scaling: float
    weights: Mapping[str, Mapping[int, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for parts in self.weights.values() for a, b in parts.values())


def load_adapter(
    name: str,
    folder: Path,
    targets: Mapping[str, tuple[int, tuple[int, ...]]],
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Read and check the adapter in ``folder`` against ``targets`` (module -> (in_features, output slice sizes))."""
    folder = Path(folder)
    config = _read_config(name, folder)
    rank, scaling = _rank_and_scaling(name, config, max_rank)
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {folder} holds adapter_model.bin; only safetensors are loaded (pickle files "
                "can run code). Save it with save_pretrained(..., safe_serialization=True)"
            )
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {folder} has no {WEIGHTS_FILE}")
    pairs = _read_pairs(name, weights_file, targets)
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (module, part), tensors in sorted(_split_fused(name, pairs, targets).items()):
        a, b = _check_pair(name, module, part, tensors, targets[module], rank)
        a, b = a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous()
        _check_finite(name, module, part, a, b, scaling)
        weights.setdefault(module, {})[part] = (a, b)
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(name=name, path=str(folder), rank=rank, scaling=scaling, weights=weights)


def _read_pairs(
    name: str, weights_file: Path, targets: Mapping[str, tuple[int, tuple[int, ...]]]
) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """{(module, slice): {"A": tensor, "B": tensor}} from the safetensors file."""
    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors file handle is not iterable)
                module, part, which = _target_of(name, key, targets)
                pairs.setdefault((module, part), {})[which] = f.get_tensor(key)
    except LoRAAdapterError:
        raise
    except Exception as exc:  # a truncated or corrupt file: safetensors raises its own error types
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {WEIGHTS_FILE}: {exc}") from None
    return pairs


def _split_fused(
    name: str,
    pairs: dict[tuple[str, int], dict[str, torch.Tensor]],
    targets: Mapping[str, tuple[int, tuple[int, ...]]],
) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """Pairs of fused targets (part ``WHOLE``) as one pair per slice: the shared A and the slice's rows of B."""
    result = {key: tensors for key, tensors in pairs.items() if key[1] != WHOLE}
    for (module, part), tensors in pairs.items():
        if part != WHOLE:
            continue
        if any(key[0] == module for key in result):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} is targeted both fused and by its parts")
        slices = targets[module][1]
        b = tensors.get("B")
        if b is not None and (b.dim() != 2 or b.shape[0] != sum(slices)):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module} has lora_B {tuple(b.shape)}; the base model needs "
                f"[{sum(slices)}, r]: was it trained on another base model?"
            )
        rows = b.split(list(slices)) if b is not None else [None] * len(slices)
        for part, b_rows in enumerate(rows):
            result[(module, part)] = {k: v for k, v in (("A", tensors.get("A")), ("B", b_rows)) if v is not None}
    return result


def _read_config(name: str, folder: Path) -> dict:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {folder} has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type is {config['peft_type']!r}; only LORA is served")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: bias={config['bias']!r}; only bias='none' is served")
    for key, defaults in _UNSUPPORTED_SETTINGS.items():
        if key in config and config[key] not in defaults:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported")
    return config


def _rank_and_scaling(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: r={rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    # rsLoRA scales by alpha / sqrt(r) instead of alpha / r (as PEFT does)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if not math.isfinite(scaling):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha={alpha!r} gives a scaling that is not finite")
    return rank, float(scaling)


def _check_finite(name: str, module: str, part: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
    """NaN or Inf in the weights as served (B scaled, both in the model dtype, where a huge lora_alpha overflows)
    would turn every token of every request on the adapter into NaN: refused at load instead."""
    for which, tensor in (("lora_A", a), ("lora_B", b)):
        if not bool(torch.isfinite(tensor).all()):
            scaled = f" scaled by {scaling:g} (lora_alpha / r)" if which == "lora_B" else ""
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module} slice {part} has NaN or Inf in {which}{scaled} as {tensor.dtype}"
            )


def _target_of(name: str, key: str, targets: Mapping[str, tuple[int, tuple[int, ...]]]) -> tuple[str, int, str]:
    match = _TENSOR.match(key)
    if match is None:
        what = "embedding or lm_head " if ("embed" in key or "lm_head" in key) else ""
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder layer's "
            f"q/k/v/o/gate/up/down projection; {what}targets are not served"
        )
    layer, proj, which = match.groups()
    if proj in FUSED_PROJECTIONS and f"layers.{layer}.{FUSED_PROJECTIONS[proj]}" in targets:
        return f"layers.{layer}.{FUSED_PROJECTIONS[proj]}", WHOLE, which
    if proj not in PROJECTIONS:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: target module {proj!r} (tensor {key!r}) is not served")
    module_suffix, part = PROJECTIONS[proj]
    module = f"layers.{layer}.{module_suffix}"
    if module not in targets:
        if any(target.startswith(f"layers.{layer}.") for target in targets):  # e.g. a mixture-of-experts layer
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: tensor {key!r} targets {proj}, which layer {layer} of this model does not "
                "have (a mixture-of-experts layer has experts, whose projections are not served)"
            )
        raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} names layer {layer}, which the model lacks")
    return module, part, which


def _check_pair(
    name: str,
    module: str,
    part: int,
    tensors: dict[str, torch.Tensor],
    target: tuple[int, tuple[int, ...]],
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if set(tensors) != {"A", "B"}:
        missing = ({"A", "B"} - set(tensors)).pop()
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} slice {part} has no lora_{missing} weight")
    a, b = tensors["A"], tensors["B"]
    in_features, slices = target
    expected_a = (a.shape[0] if a.dim() == 2 else "r", in_features)
    expected_b = (slices[part], a.shape[0] if a.dim() == 2 else "r")
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {module} slice {part} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
            f"the base model needs [r, {in_features}] and [{slices[part]}, r]: was it trained on another base model?"
        )
    if a.shape[0] != rank:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {module} slice {part} has rank {a.shape[0]}, adapter_config.json says r={rank}"
        )
    if not (a.is_floating_point() and b.is_floating_point()):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} weights must be floating point, not {a.dtype}")
    return a, b
