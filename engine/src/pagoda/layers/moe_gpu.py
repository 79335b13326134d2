"""The GPU path of :class:`pagoda.layers.moe.MoEExperts`: the whole layer as the Triton fused MoE
(:mod:`pagoda_kernels.fused_moe`: tokens sorted by expert, two grouped GEMMs).

The kernel reads the experts as ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``. The first call stacks each projection's
per-expert weights (and biases) into one tensor and then points every expert's parameter at its slice of it, so
the per-expert ``Linear`` layers and the kernel share storage: no memory is kept twice (while one layer is stacked,
its expert weights briefly exist twice). Checkpoint loading copies into the parameters in place
(``MergedLinear.load_part``), which writes through to the stacked tensor. Importing this module needs no Triton.

:func:`fused_experts` declines (returns None, the caller runs the grouped torch path) when the kernel does not
apply: not a CUDA tensor (CPU tensors only under ``TRITON_INTERPRET=1``, for tests), Triton or the kernels package
not installed, experts without a dense weight (quantized: each expert has its own kernel), LoRA on the experts,
dtypes that differ, or an activation the kernel lacks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pagoda.kernel_loading import load_kernel
from pagoda.layers.activation import SiluAndMul

if TYPE_CHECKING:
    from pagoda.layers.moe import MoEExperts

_CACHE_ATTR = "_fused_moe_weights"  # on the MoEExperts module: a _Stacked, or False when the kernel never applies


@dataclass(frozen=True, slots=True)
class MoeActivation:
    """The activation as the kernel names it, with gpt-oss's SwiGLU constants."""

    name: str  # "silu" or "swiglu_oai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True, slots=True)
class _Stacked:
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    b13: Optional[torch.Tensor]  # [E, 2I]
    b2: Optional[torch.Tensor]  # [E, H]
    activation: MoeActivation


def kernel_activation(act_and_mul: object) -> Optional[MoeActivation]:
    """The kernel's name for ``MoEExperts.act_and_mul``, or None when the kernel lacks it.

    A ``SiluAndMul("silu")`` is "silu". Any other callable names itself with a ``moe_activation`` attribute: a
    :class:`MoeActivation`, or the string "silu" / "swiglu_oai" (then ``swiglu_alpha``/``swiglu_limit``
    attributes, when present, give the constants).
    """
    named = getattr(act_and_mul, "moe_activation", None)
    if isinstance(named, MoeActivation):
        return named if named.name in ("silu", "swiglu_oai") else None
    if named in ("silu", "swiglu_oai"):
        alpha = float(getattr(act_and_mul, "swiglu_alpha", 1.702))
        return MoeActivation(named, alpha, float(getattr(act_and_mul, "swiglu_limit", 7.0)))
    if isinstance(act_and_mul, SiluAndMul) and act_and_mul.is_silu:
        return MoeActivation("silu")
    return None


def _dense_weight(layer: nn.Module) -> Optional[torch.Tensor]:
    """The layer's plain weight, or None when it runs through a kernel of its own (quantized) or has adapters."""
    weight = getattr(layer, "weight", None)
    if weight is None or weight.numel() == 0 or layer.kernel is not None or layer.lora is not None:
        return None
    return weight


def _share_storage(params: list[nn.Parameter]) -> torch.Tensor:
    """One tensor stacking ``params``, each parameter re-pointed at its slice (see the module docstring)."""
    first = params[0].data
    storage = first.untyped_storage().data_ptr()
    # Already consecutive slices of one tensor (stacked before, e.g. by an earlier call): view that block.
    same = all(p.data.is_contiguous() and p.data.untyped_storage().data_ptr() == storage for p in params)
    ptrs = [p.data.data_ptr() for p in params]
    if same and all(b - a == first.numel() * first.element_size() for a, b in zip(ptrs, ptrs[1:])):
        return first.as_strided((len(params), *first.shape), (first.numel(), *first.stride()))
    stacked = torch.stack([p.data for p in params])
    for i, p in enumerate(params):
        p.data = stacked[i]
    return stacked


def _stack(experts: MoEExperts) -> Optional[_Stacked]:
    """The stacked weights of ``experts``, or None when the kernel does not apply to them."""
    activation = kernel_activation(experts.act_and_mul)
    if activation is None or len(experts.experts) == 0:
        return None
    gate_up = [_dense_weight(e.gate_up_proj) for e in experts.experts]
    down = [_dense_weight(e.down_proj) for e in experts.experts]
    if any(w is None for w in gate_up + down):
        return None
    dtypes = {w.dtype for w in gate_up + down}
    if len(dtypes) != 1 or len({w.device for w in gate_up + down}) != 1:
        return None
    biased = [e.gate_up_proj.bias is not None for e in experts.experts]
    biased_down = [e.down_proj.bias is not None for e in experts.experts]
    if len(set(biased + biased_down)) != 1:
        return None  # mixed biases: not a layout the kernel reads
    w13, w2 = _share_storage(gate_up), _share_storage(down)
    b13 = b2 = None
    if biased[0]:
        b13 = _share_storage([e.gate_up_proj.bias for e in experts.experts])
        b2 = _share_storage([e.down_proj.bias for e in experts.experts])
    return _Stacked(w13, w2, b13, b2, activation)


def _still_shared(experts: MoEExperts, stacked: _Stacked) -> bool:
    """Whether the first and last experts' weights are still the stacked tensor's slices (a loader that replaced
    the parameters, rather than copying into them, would leave the kernel reading stale weights)."""
    first, last = experts.experts[0], experts.experts[-1]
    return (
        first.gate_up_proj.weight.data_ptr() == stacked.w13[0].data_ptr()
        and last.gate_up_proj.weight.data_ptr() == stacked.w13[-1].data_ptr()
        and first.down_proj.weight.data_ptr() == stacked.w2[0].data_ptr()
        and last.down_proj.weight.data_ptr() == stacked.w2[-1].data_ptr()
        and first.gate_up_proj.lora is None
    )


def _device_allowed(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def fused_experts(
    experts: MoEExperts,
    hidden: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
) -> Optional[torch.Tensor]:
    """``experts(hidden, topk_ids, topk_weights)`` through the Triton fused MoE -> [T, H] in hidden's dtype, or
    None when that path does not apply (see the module docstring). Never syncs with the device."""
    if not _device_allowed(hidden.device):
        return None
    kernel = load_kernel("fused_moe", "fused_moe")
    if kernel is None:
        return None
    stacked = getattr(experts, _CACHE_ATTR, None)
    if stacked is None or (stacked is not False and not _still_shared(experts, stacked)):
        # False: decided once that the kernel does not apply (the layers do not change kind after loading)
        stacked = _stack(experts) or False
        setattr(experts, _CACHE_ATTR, stacked)
    if stacked is False or stacked.w13.device != hidden.device or stacked.w13.dtype != hidden.dtype:
        return None
    act = stacked.activation
    return kernel(
        hidden,
        stacked.w13,
        stacked.w2,
        topk_weights,
        topk_ids,
        b13=stacked.b13,
        b2=stacked.b2,
        activation=act.name,
        swiglu_alpha=act.swiglu_alpha,
        swiglu_limit=act.swiglu_limit,
    )
