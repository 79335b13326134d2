"""Converters from the checkpoint formats (AWQ GEMM, GPTQ, compressed-tensors FP8) to the canonical weight forms.

Layouts, as the quantizers write them (``in``/``out``: the linear layer's input and output features, ``g``: the group
size, ``G = in / g`` groups):

- AWQ GEMM: ``qweight`` int32 ``[in, out/8]``, eight 4-bit values per int32 along the output dimension, nibble ``i``
  (bits ``4i..4i+3``) holding output column ``8c + AWQ_PACK_ORDER[i]``; ``qzeros`` int32 ``[G, out/8]`` packed the
  same way; ``scales`` fp16 ``[G, out]``; ``w = (q - z) * s``.
- GPTQ: ``qweight`` int32 ``[in*bits/32, out]`` packed along the input dimension (input ``k`` in row ``k // p``,
  bits ``bits * (k % p)``, ``p = 32 / bits``: lowest bits first); ``qzeros`` int32 ``[G, out*bits/32]`` packed along
  the output dimension the same way, holding ``zero - 1`` in the original ("gptq", v1) format and ``zero`` in
  "gptq_v2"; ``scales`` fp16 ``[G, out]``; ``g_idx`` int32 ``[in]``: the group of each input (act order makes it a
  permutation of the contiguous grouping).
- compressed-tensors FP8: ``weight`` float8_e4m3fn ``[out, in]``; ``weight_scale`` ``[out, 1]`` (per channel) or
  ``[1]``/``[]`` (per tensor); ``input_scale`` ``[1]`` when activations are static.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from pagoda.quantization.config import QuantConfig
from pagoda.quantization.weights import Fp8Weight, IntWeight

QUANT_TENSOR_SUFFIXES: dict[str, tuple[str, ...]] = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "fp8": ("weight", "weight_scale", "input_scale"),
}
# Tensors a quantized module may lack: GPTQ's g_idx (trivial grouping), FP8's input_scale (dynamic activations),
# AWQ's qzeros when the checkpoint has no zero points (zero_point false: the zero is the midpoint 2**(bits-1)).
OPTIONAL_SUFFIXES: dict[str, tuple[str, ...]] = {"awq": ("qzeros",), "gptq": ("g_idx",), "fp8": ("input_scale",)}

# Nibble i of an AWQ GEMM int32 holds output column AWQ_PACK_ORDER[i] of its group of eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_MARKER_SUFFIX = {"awq": "qweight", "gptq": "qweight", "fp8": "weight_scale"}


def is_quantized_module(method: str, names: set[str], module: str) -> bool:
    """Whether the checkpoint (its tensor ``names``) quantizes ``module``, e.g. ``model.layers.0.self_attn.q_proj``."""
    if method not in _MARKER_SUFFIX:
        raise ValueError(f"{method!r} is not a checkpoint quantization format; choose from {tuple(_MARKER_SUFFIX)}")
    return f"{module}.{_MARKER_SUFFIX[method]}" in names


def _unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split every int32 of ``packed`` into its ``32 // bits`` values (lowest bits first) along ``dim``: the
    result has ``dim`` ``32 // bits`` times longer, dtype int32, values in ``[0, 2**bits)``."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed quantized tensors must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [32 // bits]
    moved = packed.movedim(dim, -1).unsqueeze(-1)  # [..., words, 1]
    values = (moved >> shifts) & ((1 << bits) - 1)  # [..., words, 32 // bits]; the mask drops the sign extension
    return values.flatten(-2).movedim(-1, dim)


def _groups(in_features: int, group_size: int) -> int:
    size = in_features if group_size == -1 else group_size
    if size <= 0 or in_features % size != 0:
        raise ValueError(f"group size {group_size} does not divide the {in_features} input features")
    return size


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")


def int_weight_from_awq(
    qweight: torch.Tensor,
    qzeros: Optional[torch.Tensor],
    scales: torch.Tensor,
    group_size: int,
    bits: int = 4,
) -> IntWeight:
    """The canonical :class:`IntWeight` of an AWQ GEMM module (``qzeros`` None: a checkpoint without zero points,
    whose zero is the midpoint ``2**(bits-1)``)."""
    if bits != 4:
        raise ValueError(f"AWQ GEMM checkpoints are 4-bit, got bits={bits}")
    in_features, words = qweight.shape
    out_features = words * 8
    size = _groups(in_features, group_size)
    groups = in_features // size
    _check_shape("scales", scales, (groups, out_features))
    # Undo the interleave: output column j of a group of eight sits in nibble AWQ_PACK_ORDER.index(j).
    unpack_order = torch.tensor([AWQ_PACK_ORDER.index(j) for j in range(8)], device=qweight.device)

    def unpack(packed: torch.Tensor) -> torch.Tensor:  # [rows, out/8] int32 -> [rows, out] uint8
        nibbles = _unpack_int32(packed, bits, dim=1).view(packed.shape[0], -1, 8)  # [rows, out/8, 8] by nibble
        return nibbles[:, :, unpack_order].reshape(packed.shape[0], -1).to(torch.uint8)

    q = unpack(qweight).t().contiguous()  # [out, in]
    if qzeros is None:
        zeros = torch.full((groups, out_features), 1 << (bits - 1), dtype=torch.uint8, device=qweight.device)
    else:
        _check_shape("qzeros", qzeros, (groups, words))
        zeros = unpack(qzeros)
    return IntWeight(q, scales.float().contiguous(), zeros.contiguous(), size, bits)


def int_weight_from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor],
    config: QuantConfig,
) -> IntWeight:
    """The canonical :class:`IntWeight` of a GPTQ module. A non-trivial ``g_idx`` (act order) becomes ``perm``: the
    kernel reads the inputs sorted by group, so that every group is contiguous."""
    bits = config.bits
    if bits not in (4, 8):
        raise ValueError(f"GPTQ checkpoints must be 4 or 8 bits, got {bits}")
    per_word = 32 // bits
    words, out_features = qweight.shape
    in_features = words * per_word
    size = _groups(in_features, config.group_size)
    groups = in_features // size
    _check_shape("scales", scales, (groups, out_features))
    if out_features % per_word != 0:
        raise ValueError(f"GPTQ qzeros cannot pack {out_features} output features {per_word} per int32")
    _check_shape("qzeros", qzeros, (groups, out_features // per_word))

    q = _unpack_int32(qweight, bits, dim=0).t()  # [out, in] in checkpoint input order
    # v1 stored zero - 1 and masked it to `bits` bits, so a zero point of 0 was written as all ones: read modulo.
    zeros = (_unpack_int32(qzeros, bits, dim=1) + config.gptq_zero_offset) & ((1 << bits) - 1)  # [G, out]

    perm = None
    if g_idx is not None:
        _check_shape("g_idx", g_idx, (in_features,))
        contiguous = torch.arange(in_features, device=g_idx.device) // size
        g_idx = g_idx.long()
        if not torch.equal(g_idx, contiguous):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], contiguous):
                counts = torch.bincount(g_idx.clamp(min=0), minlength=groups).tolist()
                raise ValueError(
                    f"GPTQ g_idx does not assign exactly {size} inputs to each of the {groups} groups "
                    f"(group sizes {counts[:8]}{'...' if len(counts) > 8 else ''})"
                )
            q = q[:, perm]
    elif config.desc_act:
        raise ValueError("the GPTQ checkpoint says desc_act (act order) but the module has no g_idx tensor")
    return IntWeight(
        q.to(torch.uint8).contiguous(),
        scales.float().contiguous(),
        zeros.to(torch.uint8).contiguous(),
        size,
        bits,
        perm,
    )


def fp8_weight_from_checkpoint(
    weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: Optional[torch.Tensor]
) -> Fp8Weight:
    """The canonical :class:`Fp8Weight` of a compressed-tensors FP8 module (a per-tensor scale goes to every row)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"FP8 weights must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
    out_features = weight.shape[0]
    if weight_scale.numel() == 1:
        scales = weight_scale.float().reshape(1).expand(out_features)
    elif tuple(weight_scale.shape) in ((out_features, 1), (out_features,)):
        scales = weight_scale.float().reshape(out_features)
    else:
        raise ValueError(
            f"FP8 weight_scale of shape {tuple(weight_scale.shape)}: expected per-tensor [1] or per-channel "
            f"[{out_features}, 1] (block-wise scales are not supported)"
        )
    if input_scale is not None:
        if input_scale.numel() != 1:
            raise ValueError(f"FP8 input_scale must be one per-tensor value, got shape {tuple(input_scale.shape)}")
        input_scale = input_scale.float().reshape(())
    return Fp8Weight(weight.contiguous(), scales.contiguous(), input_scale)


def build_quantized_weight(config: QuantConfig, tensors: dict[str, torch.Tensor]) -> Union[IntWeight, Fp8Weight]:
    """The canonical weight of one module from its checkpoint tensors (suffix -> tensor, e.g. ``{"qweight": ...}``)."""
    if not config.serialized or config.method not in QUANT_TENSOR_SUFFIXES:
        raise ValueError(
            f"{config.method!r} (serialized={config.serialized}) is quantized at load: no checkpoint tensors"
        )
    optional = set(OPTIONAL_SUFFIXES[config.method])
    if config.method == "awq" and not config.sym:
        optional.discard("qzeros")  # asymmetric AWQ: the zero points are part of the weight
    if config.method == "fp8" and not config.fp8_dynamic_activations:
        optional.discard("input_scale")
    missing = [s for s in QUANT_TENSOR_SUFFIXES[config.method] if s not in tensors and s not in optional]
    if missing:
        raise ValueError(f"{config.describe()} module lacks checkpoint tensors {missing} (has {sorted(tensors)})")
    if config.method == "awq":
        return int_weight_from_awq(
            tensors["qweight"], tensors.get("qzeros"), tensors["scales"], config.group_size, config.bits
        )
    if config.method == "gptq":
        return int_weight_from_gptq(
            tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"), config
        )
    input_scale = None if config.fp8_dynamic_activations else tensors["input_scale"]
    return fp8_weight_from_checkpoint(tensors["weight"], tensors["weight_scale"], input_scale)
