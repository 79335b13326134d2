"""Mapping Hugging Face checkpoint tensor names onto Pagoda's (partly fused) parameters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from pagoda.layers import MergedLinear

# Pagoda's fused projections and the checkpoint modules they are made of, in order (HF stores them separately).
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# (fused module, HF module, part index), as they appear inside a parameter name
_FUSED_PARTS: tuple[tuple[str, str, int], ...] = tuple(
    (f".{fused}.", f".{part}.", index) for fused, parts in FUSED_MODULES.items() for index, part in enumerate(parts)
)
# Buffers some older checkpoints saved; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _map_name(hf_name: str) -> tuple[str, Optional[int]]:
    for fused, separate, part in _FUSED_PARTS:
        if separate in hf_name:
            return hf_name.replace(separate, fused), part
    return hf_name, None


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    skip_names: Optional[set[str]] = None,
) -> set[str]:
    """Copy (hf_name, tensor) pairs into ``model``; return the names of the parameters filled.

    Raises ValueError for a tensor with no matching parameter, a shape mismatch, or a parameter
    (or part of a fused one) the checkpoint never provided.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    filled: set[str] = set()
    parts_seen: dict[str, set[int]] = {}
    for hf_name, tensor in weights:
        if (skip_names and hf_name in skip_names) or hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        name, part = _map_name(hf_name)
        if name not in params:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} does not match any parameter of {type(model).__name__}; "
                "is config.json's architecture right for these weights?"
            )
        try:
            if part is None:
                _copy(params[name], tensor)
                filled.add(name)
            else:
                module_name, attr = name.rsplit(".", 1)
                module = modules[module_name]
                assert isinstance(module, MergedLinear), module_name
                module.load_part(attr, part, tensor)
                parts_seen.setdefault(name, set()).add(part)
        except ValueError as exc:
            raise ValueError(f"checkpoint tensor {hf_name!r}: {exc}") from exc
    for name, parts in parts_seen.items():
        module = modules[name.rsplit(".", 1)[0]]
        assert isinstance(module, MergedLinear)
        if len(parts) == len(module.output_sizes):
            filled.add(name)
    missing = sorted(_hf_names(name, modules, parts_seen.get(name, set())) for name in set(params) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing weights for {len(missing)} parameter(s): {shown}")
    return filled


def _hf_names(name: str, modules: dict[str, nn.Module], parts_seen: set[int]) -> str:
    """The checkpoint name(s) that would have filled parameter ``name``."""
    if not isinstance(modules[name.rsplit(".", 1)[0]], MergedLinear):
        return name
    hf = [name.replace(fused, sep) for fused, sep, part in _FUSED_PARTS if fused in name and part not in parts_seen]
    return ", ".join(hf)


def _copy(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, checkpoint has {tuple(tensor.shape)}")
    param.data.copy_(tensor)
